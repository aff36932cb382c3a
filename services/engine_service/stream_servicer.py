"""GenerateStream: many Generate requests over one long-lived call, one message per step.

A Generate call sends one message per changed output per engine step, for one request; with
64 streams that is 64 messages a step, and gRPC's Python stack costs ~90 CPU-us per message
on each side. The tokenizer service instead opens one GenerateStream call per engine
connection and sends every request (and abort) on it; the engine answers with one
`EngineStreamBatch` whenever outputs are ready, holding the messages of all the call's
requests, so the hop costs one message per step whatever the number of streams:

    tokenizer ── EngineStreamRequest{stream_id, generate | abort, timeout_s} ──▶ reader
                                              │ one task per request: `generate_one`
                                              ▼ (Generate's own code: checks, span, admit)
                                  engine thread's hand-over of a step: each request's
                                              │ messages built straight into the batch
    tokenizer ◀── EngineStreamBatch{[stream_id, response | end], ...} ◀── batch writer

DESIGN.md describes one Generate call per request between the two services; this departs
from it on purpose (the per-message cost above), and keeps what those calls gave: each
request has its own SERVER span (a child of the trace context in its `trace_headers`), its
own status (an `EngineStreamEnd`: the code, message and trailing metadata its Generate call
would end with, e.g. a drained engine's `pagedserve-migrate`), its own deadline
(`timeout_s`), and its own abort (an abort message, like a cancelled Generate call). One bad
request ends only itself. When the call ends (the caller half-closes and its requests
finish, or the call breaks, or the engine drains) every request still on it is aborted, its
KV blocks freed at once, as a cancelled Generate call's would be.

The batch is written by one task. A request's task does not wake per step: the engine
thread hands a step's outputs to the event loop in one callback, in which each request's
messages are built into the batch (`AsyncLLMEngine.generate_into`, no per-request async
generator, queue or copy), so a step's messages leave together; the request's task wakes
once, when the request has ended, and appends its end entry. While a write waits on flow
control, later steps' messages join the next batch: each appended to its output's entry
there (one entry per output carries every step since the last batch; a request with several
outputs, or one handed back, may have several entries, in order).

Mixed into `EngineServicer`, which provides `generate_one` and `rpc_metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import grpc

from pagedserve.v1 import engine_pb2
from services.common import tracing
from services.common.errors import ServiceError, rpc_method, status_for
from services.common.grpc_server import ENGINE_SERVICE

logger = logging.getLogger("services.engine")

_REQUEST_SPAN = f"{ENGINE_SERVICE}/Generate"  # a request's span, as on its own Generate call


class StreamBatchWriter:
    """The outgoing side of one GenerateStream call: messages gathered into one batch,
    written by `run` whenever any are ready."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self._batch = engine_pb2.EngineStreamBatch()
        # Each stream's last entry in the pending batch, while it is an open response.
        self._last: dict[int, engine_pb2.EngineGenerateResponse] = {}
        self._ready = asyncio.Event()
        self._closing = False
        self.num_batches = 0

    def add_fields(self, stream_id: int, fields: dict[str, Any]) -> None:
        """A message of `stream_id` from its field values: appended to the stream's last
        entry of the pending batch when that one is of the same output and not its last
        (the batch waited on flow control over several steps: the reader is behind), else
        built at the end of the batch. One entry then carries every step since the last
        batch, as one Generate message merges what waited (output_merge.py): the reader
        routes one entry per request per batch, not one per step."""
        last = self._last.get(stream_id)
        if last is not None and last.index == fields["index"] and not last.finish_reason:
            _append_fields(last, fields)
        else:
            entry = self._batch.outputs.add(stream_id=stream_id, response=fields)
            self._last[stream_id] = entry.response
        self._ready.set()

    def add(self, stream_id: int, response: engine_pb2.EngineGenerateResponse) -> None:
        self._last.pop(stream_id, None)
        self._batch.outputs.add(stream_id=stream_id).response.CopyFrom(response)
        self._ready.set()

    def end(
        self,
        stream_id: int,
        code: grpc.StatusCode,
        message: str,
        trailing_metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self._last.pop(stream_id, None)
        entry = self._batch.outputs.add(stream_id=stream_id)
        entry.end.code = code.value[0]
        entry.end.message = message
        entry.end.trailing_metadata.update(dict(trailing_metadata))
        self._ready.set()

    async def run(self) -> None:
        """Writes batches until `close`, then what is left."""
        while True:
            if not len(self._batch.outputs):
                # The state is checked, not the event alone: `close` may come while a
                # write waits, after the last messages were added.
                if self._closing:
                    return
                await self._ready.wait()
                self._ready.clear()
                continue
            batch, self._batch = self._batch, engine_pb2.EngineStreamBatch()
            self._last = {}
            self.num_batches += 1
            await self._context.write(batch)

    def close(self) -> None:
        self._closing = True
        self._ready.set()


def _append_fields(response: engine_pb2.EngineGenerateResponse, fields: dict[str, Any]) -> None:
    """A later message of the same output (`EngineResponseBuilder.fields`) appended to
    `response`, as the reader would merge the two (tokenizer side:
    `merging_reader.merge_engine_messages`): tokens and logprobs concatenated; the usage
    (a running count), finish, stop reason and cumulative logprob of the later one."""
    response.token_ids.extend(fields["token_ids"])
    logprobs = fields.get("logprobs")
    if logprobs:
        response.logprobs.extend(logprobs)
    prompt_logprobs = fields.get("prompt_logprobs")
    if prompt_logprobs:
        response.prompt_logprobs.extend(prompt_logprobs)
    usage = fields["usage"]
    response.usage.prompt_tokens = usage["prompt_tokens"]
    response.usage.completion_tokens = usage["completion_tokens"]
    response.usage.cached_tokens = usage["cached_tokens"]
    finish_reason = fields.get("finish_reason")
    if finish_reason is not None:
        response.finish_reason = finish_reason
    stop_reason = fields.get("stop_reason")
    if stop_reason is not None:
        response.stop_reason.CopyFrom(stop_reason)
    cumulative_logprob = fields.get("cumulative_logprob")
    if cumulative_logprob is not None:
        response.cumulative_logprob = cumulative_logprob


class EngineStreamRpcs:
    """The GenerateStream RPC (see the module docstring)."""

    rpc_metrics: Any  # provided by EngineServicer
    _stream_end_event: asyncio.Event | None = None

    async def generate_one(
        self, request: Any, context: Any, write: Any = None, batch: Any = None
    ) -> None:
        raise NotImplementedError  # provided by EngineServicer

    def end_stream_calls(self) -> None:
        """Drained: every GenerateStream call ends once its requests have (they are handed
        back meanwhile), so the server stops without waiting for its callers to hang up."""
        self._stream_calls_ending().set()

    def _stream_calls_ending(self) -> asyncio.Event:
        if self._stream_end_event is None:
            self._stream_end_event = asyncio.Event()
        return self._stream_end_event

    @rpc_method
    async def GenerateStream(self, request_iterator: Any, context: Any) -> None:
        # At once: the caller learns that this engine serves the call (an older one answers
        # UNIMPLEMENTED) before it sends anything.
        await context.send_initial_metadata(())
        writer = StreamBatchWriter(context)
        writing = asyncio.ensure_future(writer.run())
        tasks: dict[int, asyncio.Task[None]] = {}
        reading = asyncio.ensure_future(self._read_stream(request_iterator, context, writer, tasks))
        ending = asyncio.ensure_future(self._stream_calls_ending().wait())
        try:
            await asyncio.wait({reading, ending, writing}, return_when=asyncio.FIRST_COMPLETED)
            if writing.done():
                writing.result()  # the write failed: the call is broken
            if reading.done():
                reading.result()  # a malformed message (WireGuard) ends the call
            else:
                reading.cancel()  # drained: no more requests on this call
            while tasks:
                await asyncio.wait(set(tasks.values()))
            writer.close()
            await writing
        finally:
            # The call broke, was cancelled, or failed: no request of it may live on.
            for task in (reading, ending, *tasks.values()):
                task.cancel()
            writing.cancel()

    async def _read_stream(
        self,
        request_iterator: Any,
        context: Any,
        writer: StreamBatchWriter,
        tasks: dict[int, asyncio.Task[None]],
    ) -> None:
        async for message in request_iterator:
            stream_id = message.stream_id
            action = message.WhichOneof("action")
            if action == "abort":
                task = tasks.get(stream_id)
                if task is not None:
                    task.cancel()  # closing the engine's generator aborts the request
            elif action != "generate":
                writer.end(
                    stream_id,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "EngineStreamRequest needs `generate` or `abort`",
                )
            elif message.HasField("timeout_s") and not (
                math.isfinite(message.timeout_s) and message.timeout_s >= 0
            ):
                writer.end(
                    stream_id,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"timeout_s must be a finite number of seconds >= 0, got {message.timeout_s}",
                )
            elif stream_id in tasks:
                writer.end(
                    stream_id,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"stream_id {stream_id} is already in use on this call",
                )
            else:
                task = asyncio.ensure_future(
                    self._run_stream_request(stream_id, message, context, writer)
                )
                tasks[stream_id] = task
                task.add_done_callback(lambda _, sid=stream_id: tasks.pop(sid, None))
        # Half-closed by the caller: its requests run on.

    async def _run_stream_request(
        self,
        stream_id: int,
        message: engine_pb2.EngineStreamRequest,
        context: Any,
        writer: StreamBatchWriter,
    ) -> None:
        """One request under its own SERVER span; its status as its batch entry. Cancelled
        (the caller's abort, or the call ended): the engine aborts it, nothing is sent."""
        request = message.generate
        code, text = grpc.StatusCode.OK, ""
        trailing: tuple[tuple[str, str], ...] = ()

        context = RequestContext(context)

        with tracing.rpc_span(_REQUEST_SPAN, request, context) as span:
            span.set_attribute("pagedserve.engine_stream", True)
            try:
                run = self.generate_one(request, context, batch=StreamResponses(writer, stream_id))
                if message.HasField("timeout_s"):
                    await asyncio.wait_for(run, message.timeout_s)
                else:
                    await run
            except asyncio.CancelledError:
                code, text = grpc.StatusCode.CANCELLED, "aborted by the caller"
                raise
            except Exception as exc:
                code, text = status_for(exc)
                if isinstance(exc, ServiceError):
                    trailing = exc.trailing_metadata
                _log_rejected(request.request_id, code, text)
            finally:
                tracing.end_rpc_span(span, code, text)
                if self.rpc_metrics is not None:
                    self.rpc_metrics.count_rpc("Generate", code)  # as on its own call
        writer.end(stream_id, code, text, trailing)


class StreamResponses:
    """One request's view of the call's batch (servicer.ResponseBatch)."""

    __slots__ = ("_stream_id", "_writer")

    def __init__(self, writer: StreamBatchWriter, stream_id: int) -> None:
        self._writer = writer
        self._stream_id = stream_id

    def add_fields(self, fields: dict[str, Any]) -> None:
        self._writer.add_fields(self._stream_id, fields)

    def add(self, response: engine_pb2.EngineGenerateResponse) -> None:
        self._writer.add(self._stream_id, response)


class RequestContext:
    """The call's context as one request on it sees it: the trace context in the call's
    metadata is the call's own (not sampled), so a request's comes from its `trace_headers`
    only."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _log_rejected(request_id: str, code: grpc.StatusCode, message: str) -> None:
    """As `rpc_method` logs a failed call: one line, a traceback only for INTERNAL."""
    extra = {"request_id": request_id, "code": code.name}
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("request failed", extra=extra)
    else:
        logger.info("request rejected: %s", message, extra=extra)
