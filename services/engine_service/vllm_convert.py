"""Converters between vLLM's engine protocol (`vllm.grpc.engine`, the message classes of
the `smg-grpc-proto` package) and our engine's objects: pure functions, no I/O.

The protocol's `SamplingParams` is proto3 without presence on most fields, so 0 means
"unset" where 0 is not a meaningful value (vLLM's own servicer reads it the same way):
top_p 0 → 1, repetition_penalty 0 → 1, n 0 → 1; `temperature`, `max_tokens`, `logprobs`,
`prompt_logprobs` and `seed` have presence. Whatever the engine cannot honour is refused
with INVALID_ARGUMENT or UNIMPLEMENTED naming the field, never dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import grpc
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2

from engine import CompletionOutput, Logprob, RequestOutput, RequestOutputKind, SamplingParams
from engine.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    block_hash_to_int64,
)
from engine.structured_output import StructuredOutputsParams
from services.common.errors import ServiceError, invalid_argument

_NO_RANK = 1 << 30


def _unimplemented(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNIMPLEMENTED, message)


def check_generate_request(request: vllm_pb2.GenerateRequest, vocab_size: int) -> list[int]:
    """The prompt's token ids; raises for every input this engine does not take."""
    if not request.request_id:
        raise invalid_argument("request_id must not be empty")
    kind = request.WhichOneof("input")
    if kind == "text":
        raise invalid_argument(
            "text: this engine takes token ids only (`tokenized.input_ids`); tokenize in the "
            "gateway or use the pagedserve tokenizer service"
        )
    if kind is None or not request.tokenized.input_ids:
        raise invalid_argument("tokenized.input_ids must not be empty")
    for name in ("mm_inputs", "media_refs", "kv_transfer_params"):
        if request.HasField(name):
            raise _unimplemented(f"{name}: not supported by this engine")
    if request.extra_mm_inputs:
        raise _unimplemented("extra_mm_inputs: multimodal input is not supported")
    if request.HasField("kv_transfer_params_json"):
        raise _unimplemented("kv_transfer_params_json: KV transfer is not supported")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise invalid_argument(
            f"data_parallel_rank: this engine has one rank (0), got {request.data_parallel_rank}"
        )
    return check_input_ids(request.tokenized.input_ids, vocab_size)


def check_input_ids(input_ids: Sequence[int], vocab_size: int) -> list[int]:
    """The prompt's ids, each checked against the vocabulary (named as the protocol names
    them; the engine would refuse them too, under its own name)."""
    ids = list(input_ids)
    if not ids:
        raise invalid_argument("tokenized.input_ids must not be empty")
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise invalid_argument(
            f"tokenized.input_ids holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        )
    return ids


def sampling_params_from_vllm(msg: vllm_pb2.SamplingParams, *, stream: bool) -> SamplingParams:
    """`engine.SamplingParams` for a protocol request: deltas when streamed, one final
    output otherwise. Every field maps to the engine's own (structured outputs, logit
    bias, prompt truncation; stop strings are matched with the model directory's
    tokenizer, loaded on first use: engine/processing/stop_tokenizer.py); `grammar_from_first_token`
    needs nothing, as this engine runs no reasoning parser and starts every grammar at the
    first generated token. Bad values are the engine's ValueError, as INVALID_ARGUMENT."""
    kwargs: dict[str, object] = {
        "n": msg.n or 1,
        "temperature": msg.temperature if msg.HasField("temperature") else 1.0,
        "top_p": msg.top_p or 1.0,
        "top_k": msg.top_k,
        "min_p": msg.min_p,
        "frequency_penalty": msg.frequency_penalty,
        "presence_penalty": msg.presence_penalty,
        "repetition_penalty": msg.repetition_penalty or 1.0,
        "max_tokens": msg.max_tokens if msg.HasField("max_tokens") else None,
        "min_tokens": msg.min_tokens,
        "stop_token_ids": list(msg.stop_token_ids),
        "ignore_eos": msg.ignore_eos,
        "include_stop_str_in_output": msg.include_stop_str_in_output,
        "skip_special_tokens": msg.skip_special_tokens,
        "spaces_between_special_tokens": msg.spaces_between_special_tokens,
        # Text only where stop strings must be matched (engine/processing/stop_tokenizer.py): the
        # protocol's outputs are token ids.
        "detokenize": bool(msg.stop),
        "output_kind": RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
    }
    if msg.stop:
        kwargs["stop"] = list(msg.stop)
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    for name in ("logprobs", "prompt_logprobs", "seed", "truncate_prompt_tokens"):
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    constraint = msg.WhichOneof("constraint")
    if constraint is not None:
        kwargs["structured_outputs"] = _structured_outputs(msg, constraint)
    try:
        return SamplingParams(**kwargs)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise invalid_argument(f"sampling_params: {exc}") from None


def _structured_outputs(msg: vllm_pb2.SamplingParams, constraint: str) -> StructuredOutputsParams:
    """The `constraint` oneof as vLLM's StructuredOutputsParams (the engine compiles and
    enforces it; a spec the grammar library rejects is the engine's ValueError)."""
    value = getattr(msg, constraint)
    if constraint == "choice":
        value = list(value.choices)
    field = {"json_schema": "json"}.get(constraint, constraint)
    try:
        return StructuredOutputsParams(**{field: value})
    except (ValueError, TypeError) as exc:
        raise invalid_argument(f"sampling_params.{constraint}: {exc}") from None


# ---- outputs ----------------------------------------------------------------------------


def _top_logprobs(position: Mapping[int, Logprob] | None, num_top: int) -> vllm_pb2.TopLogProbs:
    """The `num_top` most likely tokens at a position, best first (the engine's dict holds
    the chosen token first, then the top-k by rank)."""
    top = vllm_pb2.TopLogProbs()
    if position and num_top > 0:
        ranked = sorted(position.items(), key=lambda item: item[1].rank or _NO_RANK)
        for token_id, logprob in ranked:
            if 0 < (logprob.rank or 0) <= num_top:
                top.token_ids.append(token_id)
                top.values.append(logprob.logprob)
    return top


def output_logprobs(completion: CompletionOutput, num_top: int) -> vllm_pb2.OutputLogProbs | None:
    if not completion.logprobs:
        return None
    msg = vllm_pb2.OutputLogProbs()
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        chosen = position.get(token_id)
        msg.token_logprobs.append(chosen.logprob if chosen is not None else float("nan"))
        msg.token_ids.append(token_id)
        if num_top:
            msg.top_logprobs.append(_top_logprobs(position, num_top))
    return msg


def input_logprobs(output: RequestOutput, num_top: int) -> vllm_pb2.InputLogProbs | None:
    """Prompt logprobs; the first position has none (an unset `value`)."""
    if not output.prompt_logprobs:
        return None
    msg = vllm_pb2.InputLogProbs()
    for token_id, position in zip(output.prompt_token_ids, output.prompt_logprobs):
        entry = vllm_pb2.InputTokenLogProb()
        if position is not None and token_id in position:
            entry.value = position[token_id].logprob
        msg.token_logprobs.append(entry)
        msg.token_ids.append(token_id)
        if num_top:
            msg.top_logprobs.append(_top_logprobs(position, num_top))
    return msg


def chunk_response(
    output: RequestOutput, completion: CompletionOutput, params: SamplingParams, first: bool
) -> vllm_pb2.GenerateResponse:
    """A streamed delta; `completion_tokens` is the delta's count (the gateway sums)."""
    chunk = vllm_pb2.GenerateStreamChunk(
        token_ids=completion.token_ids,
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=len(completion.token_ids),
        cached_tokens=output.num_cached_tokens or 0,
        index=completion.index,
    )
    logprobs = output_logprobs(completion, params.logprobs or 0)
    if logprobs is not None:
        chunk.output_logprobs.CopyFrom(logprobs)
    prompt_logprobs = input_logprobs(output, params.prompt_logprobs or 0) if first else None
    if prompt_logprobs is not None:
        chunk.input_logprobs.CopyFrom(prompt_logprobs)
    return vllm_pb2.GenerateResponse(chunk=chunk)


def complete_response(
    output: RequestOutput, completion: CompletionOutput, params: SamplingParams
) -> vllm_pb2.GenerateResponse:
    """The end of one output index. Not streamed: every token; streamed: the last delta,
    as vLLM's servicer sends it (the gateway has accumulated the chunks)."""
    complete = vllm_pb2.GenerateComplete(
        output_ids=completion.token_ids,
        finish_reason=completion.finish_reason or "stop",
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=len(completion.token_ids),
        cached_tokens=output.num_cached_tokens or 0,
        index=completion.index,
    )
    logprobs = output_logprobs(completion, params.logprobs or 0)
    if logprobs is not None:
        complete.output_logprobs.CopyFrom(logprobs)
    prompt_logprobs = input_logprobs(output, params.prompt_logprobs or 0)
    if prompt_logprobs is not None:
        complete.input_logprobs.CopyFrom(prompt_logprobs)
    if isinstance(completion.stop_reason, int):
        complete.matched_token_id = completion.stop_reason
    elif isinstance(completion.stop_reason, str):
        complete.matched_stop_str = completion.stop_reason
    return vllm_pb2.GenerateResponse(complete=complete)


# ---- KV events --------------------------------------------------------------------------


def kv_events_to_proto(
    events: Sequence[KVCacheEvent], block_size: int, first_event_id: int
) -> list[smg_common_pb2.KvCacheEvent]:
    """The engine's events as the protocol's, block hashes as signed int64
    (`block_hash_to_int64`), one event per block."""
    out: list[smg_common_pb2.KvCacheEvent] = []
    for offset, event in enumerate(events):
        msg = smg_common_pb2.KvCacheEvent(event_id=first_event_id + offset)
        if isinstance(event, BlockStored):
            block = smg_common_pb2.KvBlock(
                block_hash=block_hash_to_int64(event.block_hash),
                token_ids=event.token_ids,
                block_size=block_size,
            )
            msg.stored.blocks.append(block)
            if event.parent_block_hash is not None:
                msg.stored.parent_block_hash = block_hash_to_int64(event.parent_block_hash)
            msg.stored.tier = smg_common_pb2.KV_CACHE_TIER_DEVICE
        elif isinstance(event, BlockRemoved):
            msg.removed.block_hashes.append(block_hash_to_int64(event.block_hash))
            msg.removed.tier = smg_common_pb2.KV_CACHE_TIER_DEVICE
        elif isinstance(event, AllBlocksCleared):
            msg.cleared.SetInParent()
        out.append(msg)
    return out
