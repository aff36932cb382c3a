"""The tokenizer service's side of one request at the engines: the replica calls under their
CLIENT span, failover before the first result, migration after it, and for Generate the
relay of engine messages to the client through the request's `TextStream`.

    generate / encode ─▶ _on_some_replica: CLIENT span, pick a replica, attempt; the replica
                         failed before anything came back? mark it down, once more elsewhere;
                         a Generate stream's replica lost after that (`migration.Moved`:
                         killed, stalled, drained)? the stream continues on another replica,
                         resumed with its tokens so far (replicas/migration.py)
                         ├─▶ Generate: one stream per replica (on the replica's multiplexed
                         │   call, replicas/stream_mux.py, or a call of its own), read ahead
                         │   and relayed into the request's one TextStream (what waited while
                         │   the client was behind goes as one message: merging_reader.py);
                         │   an id refused as in use while a call of it that we cancelled may
                         │   still hold it there: tried again (replicas/cancelled_ids.py)
                         └─▶ Encode: one call per input, all on the same replica
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from pagedserve.v1 import engine_pb2
from services.common import tracing
from services.common.errors import ServiceError, engine_unreachable, status_for
from services.common.grpc_server import ENGINE_SERVICE, trace_headers, trace_metadata
from services.common.metrics import TokenizerMetrics
from services.tokenizer_service.replicas import migration
from services.tokenizer_service.replicas.engine_client import EngineBackend
from services.tokenizer_service.replicas.merging_reader import MergingReader
from services.tokenizer_service.replicas.migration import (
    HeldStream,
    Moved,
    RequestMigrations,
    TriedReplicas,
)
from services.tokenizer_service.replicas.pool import EnginePool, TrackedCall, tracked
from services.tokenizer_service.text_stream import TextStream

logger = logging.getLogger("services.tokenizer")

_ENGINE_GENERATE = f"{ENGINE_SERVICE}/Generate"  # the CLIENT spans of the engine calls
_ENGINE_ENCODE = f"{ENGINE_SERVICE}/Encode"
T = TypeVar("T")


@dataclass
class LiveRequest:
    """What the service keeps for a request in flight: its engine calls."""

    calls: list[grpc.aio.Call] = field(default_factory=list)
    aborted: bool = False
    replica: EngineBackend | None = None  # where the request runs (Abort goes there)

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()


class EngineRelay:
    """Runs a generation on a replica chosen by the pool and relays it to the client."""

    def __init__(
        self,
        pool: EnginePool,
        metrics: TokenizerMetrics,
        migration_limit: int = migration.DEFAULT_MIGRATION_LIMIT,
        stream_interval: int = 1,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.migration_limit = migration_limit
        self.stream_interval = stream_interval  # tokens per client message (merging_reader.py)

    async def generate(
        self,
        engine_request: engine_pb2.EngineGenerateRequest,
        incoming_trace_headers: dict[str, str],
        live: LiveRequest,
        stream: TextStream,
        context: grpc.aio.ServicerContext,
    ) -> None:
        """The engine call, under its CLIENT span: the parent the engine service gets, in
        the metadata and in `trace_headers`. Its messages are relayed under `detokenize`.
        After a move, the next replica gets the request resumed where the stream is."""

        async def attempt(replica: EngineBackend, headers: dict[str, str]) -> None:
            if stream.finished:
                return
            if live.aborted:  # aborted while moving: no replica holds it
                for response in stream.abort_unfinished():
                    await context.write(response)
                return
            request = migration.resume_request(engine_request, stream)
            request.trace_headers.update(headers)
            with tracing.internal_span("detokenize"):
                await self._call_replica(replica, request, headers, live, stream, context)

        def choose(tried: list[EngineBackend]) -> EngineBackend:
            return self.pool.choose(engine_request.prompt_token_ids, exclude=tried)

        await self._on_some_replica(
            _ENGINE_GENERATE,
            engine_request.request_id,
            incoming_trace_headers,
            live,
            choose,
            attempt,
            RequestMigrations(self.migration_limit, self.metrics, engine_request.request_id),
            lambda: stream.num_tokens,
        )

    async def encode(
        self,
        engine_requests: list[engine_pb2.EngineEncodeRequest],
        incoming_trace_headers: dict[str, str],
        live: LiveRequest,
        context: grpc.aio.ServicerContext,
    ) -> list[engine_pb2.EngineEncodeResponse]:
        """One engine Encode per input, all on the least loaded replica, under one CLIENT
        span; the replies in input order."""

        async def attempt(
            replica: EngineBackend, headers: dict[str, str]
        ) -> list[engine_pb2.EngineEncodeResponse]:
            for engine_request in engine_requests:
                engine_request.trace_headers.update(headers)
            with tracked(replica) as tracking:
                live.calls = [
                    replica.stub.Encode(
                        engine_request,
                        timeout=context.time_remaining(),
                        metadata=trace_metadata(headers),
                    )
                    for engine_request in engine_requests
                ]
                try:
                    replies = await asyncio.gather(*live.calls)
                except grpc.aio.AioRpcError as exc:
                    if live.aborted:
                        raise _aborted() from None
                    if engine_unreachable(exc) and tracking.pending:
                        raise FailedBeforeFirstToken(exc) from None
                    raise await replica.translate(exc) from None
                except asyncio.CancelledError:
                    if live.aborted:
                        raise _aborted() from None
                    raise
                finally:
                    live.cancel()  # the others, when one failed
                tracking.started()
                return list(replies)

        request_id = engine_requests[0].request_id if engine_requests else ""
        return await self._on_some_replica(
            _ENGINE_ENCODE,
            request_id,
            incoming_trace_headers,
            live,
            lambda tried: self.pool.least_loaded(exclude=tried),
            attempt,
        )

    async def _on_some_replica(
        self,
        span_name: str,
        request_id: str,
        incoming_trace_headers: dict[str, str],
        live: LiveRequest,
        choose: Callable[[list[EngineBackend]], EngineBackend],
        attempt: Callable[[EngineBackend, dict[str, str]], Awaitable[T]],
        migrations: RequestMigrations | None = None,
        num_tokens: Callable[[], int] = lambda: 0,
    ) -> T:
        """`attempt` on the replica `choose` picks, under the CLIENT span `span_name`; a
        replica that fails before anything came back (`FailedBeforeFirstToken`) is marked
        down and the attempt made once more on another, invisibly to the client. A stream
        whose replica is lost later (`Moved`) goes on elsewhere while `migrations` allows.
        `choose` is not offered the replicas tried before unless they have restarted since
        (`TriedReplicas`)."""
        client_span = tracing.start_client_span(span_name)
        try:
            headers = tracing.outgoing_trace_headers(incoming_trace_headers, client_span)
            tried = TriedReplicas()
            failed_over = False
            moving: tuple[str, EngineBackend] | None = None  # (reason, replica left)
            while True:
                replica = choose(tried.excluded())
                tried.add(replica)
                live.replica = replica
                if moving is not None and migrations is not None:
                    migrations.record(moving[0], moving[1], replica, num_tokens())
                    moving = None
                try:
                    return await attempt(replica, headers)
                except FailedBeforeFirstToken as failed:
                    if failed_over or not self.pool.up(exclude=tried.excluded()):
                        raise await replica.translate(failed.error) from None
                    failed_over = True
                    await replica.mark_down(failed.error)
                    self.metrics.engine_failovers.inc()
                    logger.info(
                        "engine replica failed before the first result; retrying elsewhere",
                        extra={"request_id": request_id, "engine_address": replica.address},
                    )
                except Moved as moved:
                    if moved.reason != migration.REASON_DRAINED:
                        await replica.lose(moved.reason, f"a stream of {request_id} broke")
                    elsewhere = self.pool.up(exclude=tried.excluded())
                    if migrations is None or not migrations.may_move(elsewhere):
                        raise moved.client_error(replica.address) from None
                    moving = (moved.reason, replica)
        except (Exception, asyncio.CancelledError) as exc:
            tracing.set_error(client_span, *status_for(exc))
            raise
        finally:
            client_span.end()

    async def _call_replica(
        self,
        replica: EngineBackend,
        engine_request: engine_pb2.EngineGenerateRequest,
        headers: dict[str, str],
        live: LiveRequest,
        stream: TextStream,
        context: grpc.aio.ServicerContext,
    ) -> None:
        """The request's stream on `replica`. A call of its id that we cancelled there
        lately may still hold the id on the engine: a refusal of it is then tried again,
        within a grace (replicas/cancelled_ids.py)."""
        request_id = engine_request.request_id
        release = replica.cancelled_ids.take(request_id)
        while True:
            try:
                await self._call_replica_once(
                    replica, engine_request, headers, live, stream, context
                )
                return
            except IdStillHeld as refused:
                if release is None or not await release.before_retry():
                    raise await replica.translate(refused.error) from None
                self.metrics.engine_id_retries.inc()

    async def _call_replica_once(
        self,
        replica: EngineBackend,
        engine_request: engine_pb2.EngineGenerateRequest,
        headers: dict[str, str],
        live: LiveRequest,
        stream: TextStream,
        context: grpc.aio.ServicerContext,
    ) -> None:
        with tracked(replica) as tracking, replica.watch.hold() as held:
            call = held.call = await replica.open_generate(
                engine_request, context.time_remaining(), trace_metadata(headers)
            )
            live.calls.append(call)
            if held.lost is not None or live.aborted:
                call.cancel()  # given up (or aborted) while the call was being opened
            try:
                await self._relay(call, replica, tracking, held, live, stream, context)
            finally:
                # A no-op once the call is done; else the engine aborts the request and
                # frees its blocks (a stalled replica: once it runs again).
                replica.end_generate(engine_request.request_id, call)

    async def _relay(
        self,
        call: Any,
        replica: EngineBackend,
        tracking: TrackedCall,
        held: HeldStream,
        live: LiveRequest,
        stream: TextStream,
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Engine messages → client messages until every output has ended; `Moved` when
        the replica is lost first (the call broke, was handed back, or was given up)."""

        watch = replica.watch

        def heard() -> None:  # per engine message: liveness only (the counter is per group)
            if tracking.pending:
                tracking.started()
            watch.heard()

        # Read ahead: what came while the client was behind goes out in one message.
        messages = MergingReader(
            call, heard, self.stream_interval, self.metrics.engine_messages.inc
        )
        try:
            async for waiting in messages:
                response = stream.process_messages(waiting.messages, waiting.token_ids)
                if response is not None:
                    await context.write(response)
                if stream.finished:
                    return  # stop strings ended every output: the caller cancels the call
        except asyncio.CancelledError:
            if context.cancelled() or context.done():
                raise  # our client went away
            if held.lost is not None and not live.aborted:
                raise Moved(held.lost) from None  # the replica was given up: we cancelled
            if not live.aborted:
                raise  # (an Abort cancels only the engine call)
        except grpc.aio.AioRpcError as exc:
            if stream.finished:
                return  # every output had ended: nothing to move
            if held.lost is not None and not live.aborted:
                raise Moved(held.lost, exc) from None
            if not live.aborted:
                if exc.code() == grpc.StatusCode.ALREADY_EXISTS and tracking.pending:
                    raise IdStillHeld(exc) from None  # refused before anything came back
                reason = migration.reason_for_error(exc)
                if reason is not None and tracking.pending and not stream.started:
                    raise FailedBeforeFirstToken(exc) from None  # nothing to resume yet
                if reason is not None:
                    raise Moved(reason, exc) from None
                raise await replica.translate(exc) from None
        finally:
            messages.close()
        # The engine stream ended (or an Abort cancelled it) with outputs left open.
        for response in stream.abort_unfinished():
            await context.write(response)


class FailedBeforeFirstToken(Exception):
    """The replica became unreachable before it sent anything back: safe to retry."""

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        super().__init__(str(error))
        self.error = error


class IdStillHeld(Exception):
    """The replica refused the request's id as in use, before it sent anything back."""

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        super().__init__(str(error))
        self.error = error


def outgoing_metadata(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str], ...]:
    """Trace context for an engine call made by this call: its span is the parent."""
    return trace_metadata(tracing.outgoing_trace_headers(trace_headers({}, context)))


def _aborted() -> ServiceError:
    return ServiceError(grpc.StatusCode.ABORTED, "the request was aborted")
