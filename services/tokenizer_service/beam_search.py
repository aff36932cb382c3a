"""Beam search over the engine's gRPC API, for `GenerateRequest.beam_width`.

The same bookkeeping as `LLM.beam_search` (engine/api/beam_search.py): every step sends each
live beam to the engine as a one-token greedy request asking for its top logprobs, all
beams concurrently; the engine's prefix cache shares their common blocks. The final beams
go back to the caller as outputs 0..k-1, best first, one message each.

An Abort of the request cancels the step's engine calls (they are the request's
`LiveRequest.calls`) and ends the search there: the beams found so far go back, the
unfinished ones with finish_reason ABORT.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from engine.api.beam_search import BeamSearchInstance, BeamSearchOutput
from engine.api.sampling_params import BeamSearchParams
from pagedserve.v1 import common_pb2, engine_pb2, generation_pb2
from services.common.finish_reasons import FINISH_REASONS
from services.tokenizer_service.replicas.relay import LiveRequest


async def run_beam_search(
    stub: Any,
    request_id: str,
    prompt_token_ids: list[int],
    params: BeamSearchParams,
    eos_token_ids: set[int],
    timeout: float | None,
    metadata: Any,
    cache_salt: str = "",
    lora_name: str = "",
    live: LiveRequest | None = None,
    fairness: dict[str, Any] | None = None,
) -> BeamSearchOutput:
    """`cache_salt`: the tenant's, so beams share cached blocks only within the tenant;
    `fairness`: the engine request's fairness fields (`services.security.caller.fairness_fields`);
    `lora_name`: the adapter every beam step runs with (empty: the base model); `live`: the
    request's entry, whose `aborted` flag stops the search (see the module doc)."""
    live = live if live is not None else LiveRequest()
    instance = BeamSearchInstance(prompt_token_ids, params, eos_token_ids)
    step = 0
    while not instance.done:
        if live.aborted:
            return instance.output(aborted=True)
        step_params = common_pb2.SamplingParams(
            temperature=0.0, max_tokens=1, logprobs=instance.num_candidates, ignore_eos=True
        )
        live.calls = [
            stub.Generate(
                engine_pb2.EngineGenerateRequest(
                    request_id=f"{request_id}/beam-{step}-{i}",
                    prompt_token_ids=beam.tokens,
                    sampling_params=step_params,
                    cache_salt=cache_salt,
                    lora_name=lora_name,
                    **(fairness or {}),
                ),
                timeout=timeout,
                metadata=metadata,
            )
            for i, beam in enumerate(instance.running)
        ]
        try:
            tops = await asyncio.gather(*(_top_logprobs(call) for call in live.calls))
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            # Our own task cancelled (the client went away) is not an Abort: re-raise.
            task = asyncio.current_task()
            if not live.aborted or (task is not None and task.cancelling()):
                raise
            return instance.output(aborted=True)
        finally:
            for call in live.calls:
                call.cancel()
            live.calls = []
        instance.advance(list(tops))
        step += 1
    return instance.output()


async def _top_logprobs(call: Any) -> dict[int, float]:
    """The top logprobs of the one position a one-token engine request computes."""
    top: dict[int, float] = {}
    async for msg in call:
        for position in msg.logprobs:
            top.update({e.token_id: e.logprob for e in position.top})
    return top


def beam_params_from_request(request: Any, sampling: Any) -> BeamSearchParams:
    """`BeamSearchParams` from a GenerateRequest's beam fields and its sampling params
    (max_tokens default 16, as SamplingParams). Raises ValueError naming the field."""
    return BeamSearchParams(
        beam_width=request.beam_width,
        max_tokens=sampling.max_tokens or 16,
        ignore_eos=sampling.ignore_eos,
        temperature=sampling.temperature,
        length_penalty=request.length_penalty if request.HasField("length_penalty") else 1.0,
    )


def beam_responses(
    output: BeamSearchOutput,
    request_id: str,
    prompt_token_ids: list[int],
    tokenizer: Any,
    skip_special_tokens: bool,
) -> list[generation_pb2.GenerateResponse]:
    """The final beams as outputs 0..k-1, best first, one message each (the eos token that
    stopped a beam is in its token ids, not in its text)."""
    responses = []
    for index, beam in enumerate(output.sequences):
        generated = beam.tokens[len(prompt_token_ids) :]
        shown = generated[:-1] if beam.finish_reason == "stop" else generated
        responses.append(
            generation_pb2.GenerateResponse(
                request_id=request_id,
                index=index,
                text=tokenizer.decode(shown, skip_special_tokens=skip_special_tokens),
                token_ids=generated,
                finish_reason=FINISH_REASONS[beam.finish_reason],
                usage=common_pb2.Usage(
                    prompt_tokens=len(prompt_token_ids), completion_tokens=len(generated)
                ),
                cumulative_logprob=beam.cum_logprob,
            )
        )
    return responses
