"""Converters between the protos and the engine's objects: pure functions, no I/O.

Field names of `pagedserve.v1.SamplingParams` are those of `engine.SamplingParams`, so the
conversion is by name; an unset (`optional`) field is left to the engine's default.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from engine import Logprob, PoolingParams, RequestOutput, SamplingParams
from engine.structured_output import StructuredOutputsParams
from pagedserve.v1 import common_pb2, engine_pb2
from services.common.finish_reasons import FINISH_REASONS

# The scalar `optional` fields (those with presence), in proto order; the `constraint`
# oneof and `disable_any_whitespace` go to `structured_outputs` instead.
SAMPLING_SCALAR_FIELDS: tuple[str, ...] = tuple(
    f.name
    for f in common_pb2.SamplingParams.DESCRIPTOR.fields
    if f.has_presence
    and f.message_type is None
    and (f.containing_oneof is None or f.containing_oneof.name != "constraint")
    and f.name != "disable_any_whitespace"
)
# proto `constraint` member -> StructuredOutputsParams field.
_CONSTRAINT_FIELDS = {
    "json_schema": "json",
    "regex": "regex",
    "grammar": "grammar",
    "structural_tag": "structural_tag",
    "json_object": "json_object",
    "choice": "choice",
}
_NO_RANK = 1 << 30  # sorts a rank-less entry last
# The message of a rejected parameter starts with its field name (engine.SamplingParams,
# the input processor, engine.PoolingParams); on the wire it is named by its proto path.
_FIELD_PATHS = {
    **{f.name: "sampling_params" for f in common_pb2.SamplingParams.DESCRIPTOR.fields},
    "structured_outputs": "sampling_params",
    "bad_words_token_ids": "sampling_params",
    **{f.name: "pooling_params" for f in common_pb2.PoolingParams.DESCRIPTOR.fields},
}
_LEADING_NAME = re.compile(r"[a-z_]+")


# ---- sampling parameters ----------------------------------------------------------------


def field_path_message(message: str) -> str:
    """The engine's message for a rejected parameter with the field named by its proto path
    (`top_p must be ...` -> `sampling_params.top_p must be ...`). The engine validates every
    token and sampling parameter, for the tokenizer service and for direct callers alike, so
    each rule has this one message on every path; other messages are returned unchanged."""
    name = _LEADING_NAME.match(message)
    parent = _FIELD_PATHS.get(name.group(0)) if name else None
    return f"{parent}.{message}" if parent else message


def sampling_kwargs_from_proto(msg: common_pb2.SamplingParams) -> dict[str, object]:
    """The fields the caller set, as `engine.SamplingParams` keyword arguments."""
    kwargs: dict[str, object] = {
        name: getattr(msg, name) for name in SAMPLING_SCALAR_FIELDS if msg.HasField(name)
    }
    if msg.stop:
        kwargs["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.allowed_token_ids:
        kwargs["allowed_token_ids"] = list(msg.allowed_token_ids)
    if msg.bad_words:
        kwargs["bad_words"] = list(msg.bad_words)
    if msg.bad_words_token_ids:
        kwargs["bad_words_token_ids"] = [list(t.ids) for t in msg.bad_words_token_ids]
    constraint = msg.WhichOneof("constraint")
    if constraint is not None:
        value = getattr(msg, constraint)
        if constraint == "choice":
            value = list(value.choices)
        kwargs["structured_outputs"] = StructuredOutputsParams(
            **{_CONSTRAINT_FIELDS[constraint]: value},
            disable_any_whitespace=msg.disable_any_whitespace,
        )
    return kwargs


def sampling_params_from_proto(msg: common_pb2.SamplingParams, **extra: object) -> SamplingParams:
    """`engine.SamplingParams` from the proto; `extra` sets fields the proto lacks (such as
    `output_kind`). Raises ValueError naming the field for an invalid value."""
    return SamplingParams(**{**sampling_kwargs_from_proto(msg), **extra})  # type: ignore[arg-type]


# ---- outputs ----------------------------------------------------------------------------


def stop_reason_to_proto(reason: int | str | None) -> common_pb2.StopReason | None:
    if reason is None:
        return None
    if isinstance(reason, str):
        return common_pb2.StopReason(text=reason)
    return common_pb2.StopReason(token_id=reason)


def position_logprobs_to_proto(
    position: Mapping[int, Logprob] | None, num_top: int
) -> common_pb2.PositionLogprobs:
    """One position's logprobs. The engine's dict holds the chosen token first, then the
    top-k (the chosen one not repeated); `top` is the k most likely, the chosen one included
    when it is among them. None (the first prompt position) gives an empty message."""
    msg = common_pb2.PositionLogprobs()
    if not position:
        return msg
    entries = [
        common_pb2.TokenLogprob(token_id=tid, logprob=lp.logprob, rank=lp.rank or 0)
        for tid, lp in position.items()
    ]
    msg.chosen.CopyFrom(entries[0])
    top = sorted(entries, key=lambda e: e.rank or _NO_RANK)
    msg.top.extend(e for e in top if 0 < e.rank <= num_top)
    return msg


def resumed_output_token_ids_from_proto(
    request: engine_pb2.EngineGenerateRequest,
) -> dict[int, list[int]] | None:
    """The engine's `resumed_output_token_ids` ({output index: tokens so far}), None for a
    new request. The engine checks them (engine/processing/resume.py), naming the same field."""
    if not request.resumed_output_token_ids:
        return None
    return {index: list(ids.ids) for index, ids in request.resumed_output_token_ids.items()}


class EngineResponseBuilder:
    """Turns one request's DELTA `RequestOutput`s into `EngineGenerateResponse`s: one
    message per changed output index, with the running completion-token count (which
    starts at a resumed output's tokens so far: usage counts the whole output)."""

    def __init__(
        self,
        request_id: str,
        params: SamplingParams,
        resumed_output_token_ids: Mapping[int, Sequence[int]] | None = None,
    ) -> None:
        self.request_id = request_id
        self.num_logprobs = params.logprobs or 0
        self.num_prompt_logprobs = params.prompt_logprobs or 0
        self.num_completion_tokens: defaultdict[int, int] = defaultdict(int)
        for index, token_ids in (resumed_output_token_ids or {}).items():
            self.num_completion_tokens[index] = len(token_ids)
        self.finish_reasons: dict[int, str] = {}  # index -> "stop" / "length" / "abort"
        self.pending_prompt_logprobs: list[common_pb2.PositionLogprobs] = []

    def build(self, output: RequestOutput) -> list[engine_pb2.EngineGenerateResponse]:
        return [engine_pb2.EngineGenerateResponse(**fields) for fields in self.fields(output)]

    def fields(self, output: RequestOutput) -> list[dict[str, Any]]:
        """The output's messages as `EngineGenerateResponse` field values: a GenerateStream
        batch builds its entries from them in one call each (no message to copy)."""
        if output.prompt_logprobs:
            self.pending_prompt_logprobs += [
                position_logprobs_to_proto(p, self.num_prompt_logprobs)
                for p in output.prompt_logprobs
            ]
        num_prompt = len(output.prompt_token_ids)
        num_cached = output.num_cached_tokens or 0
        messages = []
        for completion in output.outputs:
            index = completion.index
            num_completion = self.num_completion_tokens[index] + len(completion.token_ids)
            self.num_completion_tokens[index] = num_completion
            fields: dict[str, Any] = {
                "request_id": self.request_id,
                "index": index,
                "token_ids": completion.token_ids,
                "usage": {
                    "prompt_tokens": num_prompt,
                    "completion_tokens": num_completion,
                    "cached_tokens": num_cached,
                },
            }
            if completion.finish_reason is not None:
                self.finish_reasons[index] = completion.finish_reason
                fields["finish_reason"] = FINISH_REASONS[completion.finish_reason]
            if completion.logprobs:
                fields["logprobs"] = [
                    position_logprobs_to_proto(p, self.num_logprobs) for p in completion.logprobs
                ]
            if completion.cumulative_logprob is not None:
                fields["cumulative_logprob"] = completion.cumulative_logprob
            if completion.stop_reason is not None:
                fields["stop_reason"] = stop_reason_to_proto(completion.stop_reason)
            if self.pending_prompt_logprobs:
                fields["prompt_logprobs"] = self.pending_prompt_logprobs
                self.pending_prompt_logprobs = []
            messages.append(fields)
        return messages


def pooling_params_from_proto(msg: common_pb2.PoolingParams) -> PoolingParams:
    """`engine.PoolingParams` from the proto: unset fields are left to the engine's
    `PoolerConfig`. Raises ValueError naming the field for an invalid value (the engine
    checks `dimensions` against the model when the request is added)."""
    return PoolingParams(
        normalize=msg.normalize if msg.HasField("normalize") else None,
        dimensions=msg.dimensions if msg.HasField("dimensions") else None,
    )


def token_ids_prompt(token_ids: Sequence[int], cache_salt: str = "") -> dict[str, Any]:
    """The engine's prompt form for pre-tokenized input (vLLM's `TokensPrompt`), with the
    request's `cache_salt` when it has one."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
    if cache_salt:
        prompt["cache_salt"] = cache_salt
    return prompt
