"""How one request's outputs reach its caller in `AsyncLLMEngine`: two ways.

    generate()       an async generator over an `OutputStream` (an asyncio queue): the
                     caller's task wakes per output; outputs that queued while it was
                     behind come as one (output_merge.py)
    generate_into()  an `OutputCallback`: the engine thread's one hand-over per step calls
                     `on_output(output)` for every request of the step, no task woken per
                     request; the caller's task wakes once, when the request has ended

Either way the engine thread fills the sink (engine_thread.py), and a caller that goes away
(closed generator, cancelled task, failed callback) aborts the request, which frees its KV
blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engine.api.errors import EngineDeadError
from engine.api.outputs import RequestOutput
from engine.api.sampling_params import SamplingParams
from engine.core.engine_request import EngineRequest
from engine.front.engine_commands import (
    END_OF_STREAM,
    AbortCommand,
    AddCommand,
    OutputCallback,
    OutputStream,
)
from engine.front.engine_thread import EngineThread, raise_if_dead
from engine.front.output_merge import merge_outputs

if TYPE_CHECKING:
    from engine.front.llm_engine import PromptType

_NOTHING = object()  # no item held back


def generation_request(
    prompt: PromptType,
    sampling_params: SamplingParams,
    request_id: str,
    lora_request: Any,
    trace_headers: Mapping[str, str] | None,
    priority: int,
    resumed_output_token_ids: Mapping[int, Sequence[int]] | None,
    fairness_key: str | None,
    fairness_weight: float,
) -> EngineRequest:
    """A generate request for the engine thread (checked further when it is added)."""
    if not isinstance(sampling_params, SamplingParams):
        raise TypeError(
            f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}."
        )
    return EngineRequest.build(
        request_id,
        prompt,
        sampling_params,
        time.time(),
        lora_request,
        trace_headers,
        priority,
        resumed_output_token_ids,
        fairness_key,
        fairness_weight,
    )


async def stream_outputs(thread: EngineThread, request: EngineRequest) -> AsyncGenerator[Any, None]:
    """Submits `request` and yields its outputs until the finished one."""
    request_id = request.request_id
    stream = OutputStream(request_id, asyncio.get_running_loop())
    thread.submit(AddCommand(stream, request))
    done = False
    kind = getattr(request.params, "output_kind", None)  # None: a pooling request
    held: Any = _NOTHING  # what came after outputs that were merged: handled next
    try:
        while True:
            if held is _NOTHING:
                item = await stream.queue.get()
            else:
                item, held = held, _NOTHING
            if item is END_OF_STREAM:
                done = True
                return
            if isinstance(item, BaseException):
                done = True
                if isinstance(item, EngineDeadError):
                    raise_if_dead(item)
                raise item
            # Behind the engine: every output queued since the last read goes as one.
            while kind is not None and not item.finished and not stream.queue.empty():
                following = stream.queue.get_nowait()
                if not isinstance(following, RequestOutput):
                    held = following
                    break
                item = merge_outputs(item, following, kind)
            done = item.finished
            yield item
            if done:
                return
    finally:
        if not done:  # the consumer went away (closed, cancelled): free the request
            with contextlib.suppress(EngineDeadError):
                thread.submit(AbortCommand([request_id], stream))


async def outputs_into(
    thread: EngineThread, request: EngineRequest, on_output: Callable[[Any], None]
) -> None:
    """Submits `request` and hands each of its outputs to `on_output` (on this event loop,
    in the engine thread's hand-over of each step) until the finished one."""
    sink = OutputCallback(request.request_id, asyncio.get_running_loop(), on_output)
    thread.submit(AddCommand(sink, request))
    try:
        await sink.done
    except EngineDeadError as exc:
        raise_if_dead(exc)
    finally:
        if not sink.ended:  # the consumer left or `on_output` failed: free the request
            sink.done.cancel()  # nothing more is handed over
            with contextlib.suppress(EngineDeadError):
                thread.submit(AbortCommand([request.request_id], sink))
