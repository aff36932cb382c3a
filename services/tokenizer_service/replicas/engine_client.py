"""The tokenizer service's link to one engine replica: one channel, a background poll of
its health and load, its `ModelInfo`, and the translation of its errors.

A replica is available while its standard health check says SERVING (and, among several
replicas, while it serves the same model as the others). A call that finds it unreachable
marks it down at once; the next poll that finds it SERVING brings it back. The channel
reconnects with a short backoff, so a restarted engine is found within about a second.
Its `ModelInfo` is read again whenever it (re)joins or its KV cache size changes (an engine
restarted with another configuration between two polls).

The replica also watches the Generate streams it holds (`migration.StreamWatch`): silence on
all of them for the stall timeout while it does not answer its health check either (a live
replica prefilling moved streams can be silent that long), or a NOT_SERVING health with
`engine_stalled_s` (its watchdog saw a step make no progress), is a stall. A stalled replica
leaves routing; its streams are given up as "stalled" only when another replica is up to
take them: with nowhere to go they wait for it to recover (each call still ends at its own
deadline), since ending them would turn one slow replica into an outage. A call that finds
the replica gone gives them up as "killed". Given-up streams have their calls cancelled
and move to another replica (replicas/migration.py).
`services/tokenizer_service/replicas/pool.py` holds the replicas and routes among them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.common.errors import ServiceError, engine_call_error, engine_unreachable
from services.common.grpc_server import DEFAULT_MAX_MESSAGE_BYTES, ENGINE_SERVICE
from services.common.migration import (
    INSTANCE_DETAIL,
    REASON_DRAINED,
    REASON_KILLED,
    REASON_STALLED,
    migrate_reason,
)
from services.tokenizer_service.replicas.cancelled_ids import CancelledIds
from services.tokenizer_service.replicas.migration import DEFAULT_STALL_TIMEOUT_S, StreamWatch
from services.tokenizer_service.replicas.stream_mux import EngineStreamMux

logger = logging.getLogger("services.tokenizer_service.replicas.engine_client")

_CHECK_TIMEOUT_S = 1.0

OnHealthChange = Callable[[bool, str], Awaitable[None]]
# How long a channel replaced by a credential reload keeps its open calls (streams).
RETIRE_GRACE_S = 600.0
ChannelOption = tuple[str, int | str]


def open_engine_channel(
    address: str,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    options: Sequence[ChannelOption] = (),
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> grpc.aio.Channel:
    """The one place a channel to an engine replica is opened: insecure unless
    `credentials` are given; `options` are added to (and override) the defaults.

    The receive window stays at gRPC's initial one (no BDP probing): when this service is
    behind the engine's stream, the engine's messages then wait on the engine's side, where
    the next batch takes in every step since the last (stream_servicer.py), instead of in
    this channel's buffers, from which the relay would read them one engine step per turn
    of its event loop and write one token per client message, never catching up. With
    probing the window grows to megabytes: at 20k tokens/s over 256 streams the relay fell
    ~10 s behind the engine, at one client message per token (docs/benchmarks.md, "The
    tokenizer service at a GPU's token rate")."""
    merged: dict[str, int | str] = {
        "grpc.max_send_message_length": max_message_bytes,
        "grpc.max_receive_message_length": max_message_bytes,
        "grpc.initial_reconnect_backoff_ms": 100,
        "grpc.min_reconnect_backoff_ms": 100,
        "grpc.max_reconnect_backoff_ms": 1000,
        "grpc.http2.bdp_probe": 0,
    }
    merged.update(dict(options))
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(merged.items()))
    return grpc.aio.secure_channel(address, credentials, options=list(merged.items()))


@dataclass
class ReplicaLoad:
    """What the replica's own Health RPC reported at the latest poll."""

    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0


class EngineBackend:
    """One engine replica."""

    def __init__(
        self,
        address: str,
        on_health_change: OnHealthChange,
        *,
        poll_interval_s: float = 1.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: Sequence[ChannelOption] = (),
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        multiplex: bool = True,
    ) -> None:
        """`credentials` (TLS / mTLS to the engine) and `extra_options` (e.g. the TLS
        name override) come from `services.security.tls.EngineLinkTLS`; None: plaintext.
        `multiplex`: Generate requests go over one GenerateStream call (stream_mux.py)."""
        self.address = address
        self._multiplex = multiplex
        self.stream_mux: EngineStreamMux | None = None
        self._channel_options = channel_options
        self._max_message_bytes = max_message_bytes
        self.watch = StreamWatch(stall_timeout_s)  # the Generate streams it holds
        self.cancelled_ids = CancelledIds()  # ids whose calls we cancelled: maybe still held
        self._open(credentials)
        self.model_info: common_pb2.ModelInfo | None = None
        self.available = False
        self.instance: str | None = None  # its process (INSTANCE_DETAIL): TriedReplicas
        self.load = ReplicaLoad()
        self.num_inflight = 0  # this service's calls open on the replica
        self.num_pending = 0  # ... of which no message has come back yet (queued, for us)
        # Set by the pool: whether `model_info` may serve (None: accept anything).
        self.accepts_model: Callable[[EngineBackend], bool] | None = None
        self.serves_another_model = False  # set by the pool's check
        # Set by the pool: whether another replica is up to take this one's streams (None:
        # a replica on its own, whose streams a stall gives up to the caller).
        self.others_up: Callable[[EngineBackend], bool] | None = None
        # Set by the pool: awaited when the replica is about to become available, before
        # anything is routed to it (services/tokenizer_service/replicas/lora_sync.py).
        self.before_available: Callable[[EngineBackend], Awaitable[None]] | None = None
        self._on_health_change = on_health_change
        self._poll_interval_s = poll_interval_s
        self._poke = asyncio.Event()
        self._retiring: set[asyncio.Task[None]] = set()  # old channels closing
        self._poll_task: asyncio.Task[None] | None = None

    def _open(self, credentials: grpc.ChannelCredentials | None) -> None:
        self.channel = open_engine_channel(
            self.address,
            credentials=credentials,
            options=self._channel_options,
            max_message_bytes=self._max_message_bytes,
        )
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        self._health_stub = health_pb2_grpc.HealthStub(self.channel)
        old_mux = self.stream_mux
        if self._multiplex:
            # Each batch is news from the replica: its streams' liveness, once per batch.
            self.stream_mux = EngineStreamMux(self.stub, self.address, self.watch.heard)
        if old_mux is not None:
            old_mux.retire()  # its requests finish on the old channel
            self.stream_mux.num_batches = old_mux.num_batches  # a counter goes on

    def replace_credentials(self, credentials: grpc.ChannelCredentials | None) -> None:
        """New calls go over a new channel with `credentials` (a rotated client
        certificate); calls open on the old one finish there, as a TLS session keeps the
        certificate it was set up with, within `RETIRE_GRACE_S`, after which it closes."""
        old = self.channel
        self._open(credentials)
        self._retiring.add(asyncio.create_task(old.close(RETIRE_GRACE_S)))
        self._retiring = {t for t in self._retiring if not t.done()}

    def start(self) -> None:
        self._poll_task = asyncio.create_task(self._poll_loop())

    async def close(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
        if self.stream_mux is not None:
            await self.stream_mux.close()
        await self.channel.close()

    async def open_generate(
        self,
        request: engine_pb2.EngineGenerateRequest,
        timeout: float | None,
        metadata: tuple[tuple[str, str], ...],
    ) -> Any:
        """The call of one Generate request, to async-iterate and cancel: on the
        multiplexed call where the engine serves it, else a call of its own (with the
        trace context in `metadata`; the multiplexed one carries it in `trace_headers`)."""
        mux = self.stream_mux
        if mux is not None and await mux.available() and mux.accepting:
            return mux.generate(request, timeout)
        return self.stub.Generate(request, timeout=timeout, metadata=metadata)

    def end_generate(self, request_id: str, call: Any) -> None:
        """Cancels the Generate `call` if it is still open (the engine aborts the request
        and frees its blocks). A call cancelled, now or before (an abort, a migration),
        leaves its id in `cancelled_ids`: the engine may hold it a little longer
        (replicas/cancelled_ids.py)."""
        if call.cancel() or call.cancelled():
            self.cancelled_ids.add(request_id)

    @property
    def num_waiting(self) -> int:
        """The replica's queue as this service sees it: the engine's own count from the
        last poll, or the calls sent since that have not started, whichever is larger."""
        return max(self.load.num_waiting, self.num_pending)

    # ---- health ---------------------------------------------------------------------------

    def poke(self) -> None:
        """Poll now rather than at the next interval."""
        self._poke.set()

    async def _poll_loop(self) -> None:
        while True:
            answered = await self._check()
            # Silence alone is not a stall: a live replica prefilling streams moved to it can
            # send nothing for longer than the timeout (losing them with nowhere left to go).
            # A stopped or partitioned process cannot answer its health check either; a live
            # one whose engine is wedged reports that itself (engine_stalled_s, in _check).
            if self.watch.stalled() and not answered:
                await self._stalled(f"sent nothing for {self.watch.silent_s():.1f} s")
            self._poke.clear()
            # asyncio.TimeoutError, not TimeoutError: they differ before Python 3.11.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._poke.wait(), self._poll_interval_s)

    async def _check(self) -> bool:
        """Polls health and load; whether the replica answered SERVING."""
        answered = False
        try:
            reply = await self._health_stub.Check(
                health_pb2.HealthCheckRequest(service=ENGINE_SERVICE), timeout=_CHECK_TIMEOUT_S
            )
            serving = answered = reply.status == health_pb2.HealthCheckResponse.SERVING
            reason = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            details = await self._read_load()
            if not serving and "engine_stalled_s" in details and self.watch.streams:
                await self._stalled(f"no step progress for {details['engine_stalled_s']} s")
            if serving and (
                self.model_info is None
                or not self.available
                or details.get("num_kv_blocks", str(self.model_info.num_kv_blocks))
                != str(self.model_info.num_kv_blocks)
            ):
                # (Re)connected: the engine may have restarted with another configuration.
                self.model_info = await self.stub.GetModelInfo(
                    common_pb2.GetModelInfoRequest(), timeout=_CHECK_TIMEOUT_S
                )
            if serving and self.accepts_model is not None and not self.accepts_model(self):
                serving, reason = False, "serves another model than the other replicas"
            if serving and not self.available and self.before_available is not None:
                await self.before_available(self)  # still unrouted: e.g. its LoRA adapters
        except grpc.aio.AioRpcError as exc:
            serving, reason = False, f"{exc.code().name}: {exc.details()}"
        await self._set_available(serving, reason)
        return answered

    async def _read_load(self) -> dict[str, str]:
        # A not-sampled trace context: with the usual parent-based sampler the engine records
        # no trace for a poll that runs every second.
        unsampled = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00"
        reply = await self.stub.Health(
            common_pb2.HealthRequest(),
            timeout=_CHECK_TIMEOUT_S,
            metadata=(("traceparent", unsampled),),
        )
        details = reply.details
        self.instance = details.get(INSTANCE_DETAIL, self.instance)
        with contextlib.suppress(KeyError, ValueError):
            self.load = ReplicaLoad(
                num_waiting=int(details["num_waiting_requests"]),
                num_running=int(details["num_running_requests"]),
                kv_cache_usage=float(details["kv_cache_usage"]),
            )
        return dict(details)

    async def _set_available(self, available: bool, reason: str) -> None:
        if available == self.available:
            return
        self.available = available
        log = logger.warning if "another model" in reason else logger.info
        log(
            "engine backend %s",
            "reachable" if available else "unreachable",
            extra={"engine_address": self.address, "reason": reason},
        )
        await self._on_health_change(available, reason)

    async def wait_until_available(self, timeout: float) -> bool:
        """Polls until the engine serves (used at start-up); False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.available and loop.time() < deadline:
            self._poke.set()
            await asyncio.sleep(0.05)
        return self.available

    # ---- errors ---------------------------------------------------------------------------

    async def mark_down(self, exc: grpc.aio.AioRpcError) -> None:
        """An unreachable replica is taken out of routing at once (the poll brings it back).
        The streams it holds stay where they are: each moves when its own call breaks, is
        handed back, or the replica stalls. A new call can fail where running ones still
        flow (a rotated TLS credential the replica no longer accepts: the open connection
        keeps its old handshake)."""
        detail = f"{exc.code().name}: {exc.details()}"
        reason = REASON_DRAINED if migrate_reason(exc) == REASON_DRAINED else REASON_KILLED
        await self._set_available(False, f"{reason}: {detail}")
        self._poke.set()

    async def _stalled(self, detail: str) -> None:
        """Out of routing; its streams move only if another replica is up to take them,
        else they stay (it may recover; each call ends at its own deadline)."""
        if self.others_up is not None and not self.others_up(self):
            reason = f"{REASON_STALLED}: {detail} (its streams wait: no other replica is up)"
            await self._set_available(False, reason)
            return
        await self.lose(REASON_STALLED, detail)

    async def lose(self, reason: str, detail: str) -> None:
        """Out of routing, and every stream it holds moves away (`reason`: migration's)."""
        moved = self.watch.lose(reason)
        if moved:
            logger.warning(
                "engine replica lost: moving its streams",
                extra={"engine_address": self.address, "reason": reason, "streams": moved},
            )
        await self._set_available(False, f"{reason}: {detail}")
        self._poke.set()

    async def translate(self, exc: grpc.aio.AioRpcError) -> ServiceError:
        """The error for our client; an unreachable engine is also marked down."""
        if engine_unreachable(exc):
            await self.mark_down(exc)
        return engine_call_error(exc, self.address)
