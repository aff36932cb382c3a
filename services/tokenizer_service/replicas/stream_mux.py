"""Every Generate stream to one engine replica over one GenerateStream call (the engine's
side: services/engine_service/stream_servicer.py, which says why the hop departs from
DESIGN.md's one call per request).

    relay ─▶ EngineStreamMux.generate(request) ─▶ MuxedGenerateCall (one per request)
                 │ start / abort messages ─────▶ the call's request stream
                 ▼
    reader task: each EngineStreamBatch ─▶ route every entry by stream id ─▶ its call

A `MuxedGenerateCall` behaves as the grpc.aio call of a per-request Generate does where the
relay, the merging reader and migration touch it: it async-iterates the request's
`EngineGenerateResponse`s; `cancel()` ends it (iteration raises asyncio.CancelledError)
and aborts the request on the engine; it ends with `grpc.aio.AioRpcError` carrying the
status, message and trailing metadata the request's own call would have ended with (its
`EngineStreamEnd`: a drained engine's `pagedserve-migrate`, INVALID_ARGUMENT naming the
field, ...), DEADLINE_EXCEEDED at its timeout, and the call's own error when the call
breaks (an engine killed: UNAVAILABLE for every request on it, so each one migrates).

A consumer that wants no task of its own subscribes instead of iterating
(`MuxedGenerateCall.subscribe`, what the relay's merging reader does): the mux's reader then
hands each entry of a batch straight to it, in the same pass over the batch, with no queue
or wake-up per request in between; its end (OK, an error, a cancel, a deadline) likewise.

The first use opens the call and waits for the engine's first answer (its initial
metadata): an engine without GenerateStream answers UNIMPLEMENTED, and the replica then
uses per-request calls (said once in the log) until the channel is replaced.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import secrets
from collections.abc import Callable
from typing import Any

import grpc

from pagedserve.v1 import engine_pb2

logger = logging.getLogger("services.tokenizer_service.replicas.stream_mux")

_END = object()  # the engine's end entry said OK


def _rpc_error(
    code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()
) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details
    )


def _status_code(value: int) -> grpc.StatusCode:
    return next((c for c in grpc.StatusCode if c.value[0] == value), grpc.StatusCode.UNKNOWN)


class MuxedGenerateCall:
    """One request on a multiplexed call, seen as its own Generate call (module docstring)."""

    def __init__(self, mux: EngineStreamMux, stream_id: int, timeout: float | None) -> None:
        self._mux = mux
        self.stream_id = stream_id
        self._responses: collections.deque[Any] = collections.deque()
        self._arrived = asyncio.Event()
        self._error: BaseException | None = None
        self._done = False
        self._deadline: asyncio.TimerHandle | None = None
        if timeout is not None:
            self._deadline = asyncio.get_running_loop().call_later(timeout, self._expired)
        self._on_response: Callable[[Any], None] | None = None  # subscribed (push mode)
        self._on_end: Callable[[BaseException | None], None] | None = None

    def subscribe(
        self,
        on_response: Callable[[engine_pb2.EngineGenerateResponse], None],
        on_end: Callable[[BaseException | None], None],
    ) -> None:
        """Push mode, in place of iteration: `on_response` gets each response as the mux's
        reader routes it, `on_end` the end (None: OK; else the error iteration would have
        raised: the call's, DEADLINE_EXCEEDED, or CancelledError after `cancel()`). What
        came before is pushed now."""
        while self._responses:
            item = self._responses.popleft()
            if item is _END or isinstance(item, BaseException):
                on_end(None if item is _END else item)
                return
            on_response(item)
        if self._error is not None:
            on_end(self._error)
            return
        self._on_response, self._on_end = on_response, on_end

    # ---- from the mux -----------------------------------------------------------------

    def deliver(self, response: engine_pb2.EngineGenerateResponse) -> None:
        if self._done:
            return
        on_response = self._on_response
        if on_response is not None:
            try:
                on_response(response)
            except Exception as exc:  # the consumer's failure ends its request, not the call
                self._mux.abort(self.stream_id)
                self._settle(exc)
            return
        self._responses.append(response)
        self._arrived.set()

    def finish(self, error: BaseException | None) -> None:
        """The request ended: OK (None) or with `error`, after what was delivered."""
        if self._done:
            return
        if self._on_end is None:
            self._responses.append(_END if error is None else error)
        self._settle(error)

    def _settle(self, error: BaseException | None) -> None:
        self._done = True
        if self._deadline is not None:
            self._deadline.cancel()
        self._mux.forget(self.stream_id)
        on_end, self._on_response, self._on_end = self._on_end, None, None
        if on_end is not None:
            on_end(error)
        else:
            self._arrived.set()

    def _expired(self) -> None:
        if not self._done:
            self._mux.abort(self.stream_id)
            self._error = _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            self._settle(self._error)

    # ---- as a grpc.aio call -----------------------------------------------------------

    def cancel(self) -> bool:
        """Ends the request here and on the engine (which frees its KV blocks); False if
        it had ended already."""
        if self._done:
            return False
        self._mux.abort(self.stream_id)
        self._error = asyncio.CancelledError()
        self._settle(self._error)
        return True

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return isinstance(self._error, asyncio.CancelledError)

    def __aiter__(self) -> MuxedGenerateCall:
        return self

    async def __anext__(self) -> engine_pb2.EngineGenerateResponse:
        while True:
            if self._error is not None:  # cancelled or expired here: what waits is dropped
                raise self._error
            if self._responses:
                item = self._responses.popleft()
                if item is _END:
                    self._responses.appendleft(item)
                    raise StopAsyncIteration
                if isinstance(item, BaseException):
                    self._error = item
                    raise item
                return item
            self._arrived.clear()
            await self._arrived.wait()


class EngineStreamMux:
    """The GenerateStream call of one replica's channel (module docstring)."""

    def __init__(self, stub: Any, address: str, on_batch: Callable[[], None] | None = None) -> None:
        """`on_batch` runs as each batch arrives (the replica's liveness: a subscriber
        hears of its own messages once per group, not per message)."""
        self.stub = stub
        self.address = address
        self._on_batch = on_batch
        self.supported: bool | None = None  # None: not known yet
        self._ids = itertools.count(1)
        self._streams: dict[int, MuxedGenerateCall] = {}
        self._call: Any = None
        self._outgoing: asyncio.Queue[engine_pb2.EngineStreamRequest | None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._opening: asyncio.Future[bool] | None = None
        self._retiring = False
        self._failed = _rpc_error(grpc.StatusCode.UNAVAILABLE, "the engine call ended")
        self.num_batches = 0  # batches received (tests, benchmarks)

    @property
    def open(self) -> bool:
        return self._call is not None and not self._call.done()

    @property
    def accepting(self) -> bool:
        """Whether `generate` may be called now (open, and not retiring)."""
        return self.open and not self._retiring

    async def available(self) -> bool:
        """Whether requests go over the multiplexed call: opens it if it is not open (and
        the engine is not known to lack it). Concurrent callers share one opening."""
        if self.supported is False or self._retiring:
            return False
        if self.open:
            return True
        if self._opening is None or self._opening.done():
            self._opening = asyncio.ensure_future(self._open())
        return await asyncio.shield(self._opening)

    async def _open(self) -> bool:
        outgoing: asyncio.Queue[engine_pb2.EngineStreamRequest | None] = asyncio.Queue()
        # A not-sampled trace context: the long-lived call's own span records nothing; each
        # request carries its own context in its `trace_headers`.
        unsampled = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00"
        call = self.stub.GenerateStream(_drain(outgoing), metadata=(("traceparent", unsampled),))
        with contextlib.suppress(grpc.aio.AioRpcError):  # the call's status says why
            await call.initial_metadata()  # the engine's first answer: it serves the call
        if call.done():
            code = await call.code()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                self.supported = False
                logger.warning(
                    "the engine replica has no GenerateStream (an older engine service): "
                    "one Generate call per request",
                    extra={"engine_address": self.address},
                )
                return False
            # Unreachable, most likely: the requests waiting for the call fail as theirs would.
            self._failed = _rpc_error(code, await call.details() or code.name)
        else:
            self.supported = True
        self._call, self._outgoing = call, outgoing
        self._reader = asyncio.ensure_future(self._read(call))
        return True

    def generate(
        self, request: engine_pb2.EngineGenerateRequest, timeout: float | None
    ) -> MuxedGenerateCall:
        """Starts `request` on the call (`available()` said it is open just before; a call
        that broke since fails the request as UNAVAILABLE, as a broken channel would)."""
        stream_id = next(self._ids)
        muxed = MuxedGenerateCall(self, stream_id, timeout)
        if not self.accepting or self._outgoing is None:
            muxed.finish(self._failed)
            return muxed
        self._streams[stream_id] = muxed
        message = engine_pb2.EngineStreamRequest(stream_id=stream_id, generate=request)
        if timeout is not None:
            message.timeout_s = timeout
        self._outgoing.put_nowait(message)
        return muxed

    def abort(self, stream_id: int) -> None:
        if stream_id in self._streams and self._outgoing is not None and self.open:
            message = engine_pb2.EngineStreamRequest(
                stream_id=stream_id, abort=engine_pb2.EngineStreamAbort()
            )
            self._outgoing.put_nowait(message)

    def forget(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)
        if self._retiring and not self._streams:
            self._half_close()

    async def _read(self, call: Any) -> None:
        """Routes every entry of every batch; when the call ends, fails what is left on it
        as a per-request call on a broken connection would fail."""
        error: BaseException = _rpc_error(
            grpc.StatusCode.UNAVAILABLE, "the engine ended the multiplexed call"
        )
        try:
            streams = self._streams
            on_batch = self._on_batch
            async for batch in call:
                self.num_batches += 1
                if on_batch is not None:
                    on_batch()
                for entry in batch.outputs:  # per token: each lookup here counts
                    muxed = streams.get(entry.stream_id)
                    if muxed is None:
                        continue  # cancelled here meanwhile
                    if entry.HasField("end"):
                        muxed.finish(_end_error(entry.end))
                    else:
                        muxed.deliver(entry.response)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = _rpc_error(grpc.StatusCode.CANCELLED, "the engine call was closed")
            raise
        finally:
            for muxed in list(self._streams.values()):
                muxed.finish(error)
            self._streams.clear()

    def retire(self) -> None:
        """The channel is being replaced: no new requests here; the call half-closes once
        the requests on it have ended."""
        self._retiring = True
        if not self._streams:
            self._half_close()

    def _half_close(self) -> None:
        if self._outgoing is not None:
            self._outgoing.put_nowait(None)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


async def _drain(outgoing: asyncio.Queue[Any]) -> Any:
    """The call's request stream: what `outgoing` gets, until None."""
    while (message := await outgoing.get()) is not None:
        yield message


def _end_error(end: engine_pb2.EngineStreamEnd) -> grpc.aio.AioRpcError | None:
    if end.code == 0:
        return None
    code = _status_code(end.code)
    return _rpc_error(code, end.message, tuple(end.trailing_metadata.items()))
