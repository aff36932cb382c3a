"""The engine service process: one gRPC server for one `AsyncLLMEngine`.

It serves `pagedserve.v1.EngineService` (the servicer: services/engine_service/servicer.py)
and, on the same port, vLLM's engine protocol, `vllm.grpc.engine.VllmEngine`
(`services/engine_service/vllm_servicer.py`), for gateways such as smg and llm-d; both APIs share
the engine, the in-flight request table, health and reflection.

Lifecycle (docs/grpc.md "Migration"):

    SIGTERM ─▶ NOT_SERVING on both health services at once; new calls refused
            ─▶ in-flight streams run for `shutdown_grace_s`
            ─▶ the rest are handed back: UNAVAILABLE + trailing `pagedserve-migrate: drained`
               (services/common/migration.py), so the tokenizer service resumes them elsewhere
            ─▶ the process exits 0
    a step running longer than `engine_stall_timeout_s` ─▶ NOT_SERVING (watchdog.py),
            SERVING again when steps return

A request resumed from another replica carries `resumed_output_token_ids`; the engine
checks and continues it (engine/processing/resume.py).

Observability (docs/observability.md): each RPC has a SERVER span (`rpc_method`), which is
the parent passed to the engine as the request's trace headers, so the engine's
`llm_request` span is its child; `/metrics` (`metrics_address`) serves the RPC counts and
the engine's own registry; the engine's stats line is logged every `log_stats_interval_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

from engine import AsyncLLMEngine, EngineDeadError
from pagedserve.v1 import engine_pb2_grpc
from services.common.errors import ConfigError
from services.common.grpc_server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ENGINE_SERVICE,
    HealthReporter,
    bind,
    create_server,
    enable_reflection,
)
from services.common.metrics import EngineServiceMetrics, MetricsEndpoint
from services.common.wire import WireGuard
from services.engine_service.servicer import EngineServicer, model_info_from_config
from services.engine_service.vllm_servicer import VLLM_ENGINE_SERVICE, VllmEngineServicer
from services.engine_service.watchdog import EngineWatchdog
from services.security.tls import ServerTLS, ServerTLSConfig, is_loopback

logger = logging.getLogger("services.engine")

_ENGINE_WATCH_INTERVAL_S = 0.5
# After the grace period, how long handed-back streams get to end with their status before
# the server cancels what is left.
_HAND_BACK_MARGIN_S = 2.0
_DRAIN_POLL_S = 0.05


@dataclass
class EngineServerConfig:
    address: str = "127.0.0.1:50052"
    max_inflight_requests: int = 1024  # more → RESOURCE_EXHAUSTED
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    shutdown_grace_s: float = 10.0  # in-flight streams left after this are handed back
    # A step running longer than this turns health NOT_SERVING (0: no watchdog).
    engine_stall_timeout_s: float = 10.0
    metrics_address: str | None = None  # host:port of /metrics (port 0: a free one); None: off
    metrics_name_prefix: str = "pagedserve"  # or "vllm": vLLM's metric names on /metrics
    log_stats_interval_s: float = 10.0  # the engine's stats line every so often; 0: never
    tls: ServerTLSConfig | None = None  # None: plaintext (loopback only, or allow_insecure)
    allow_insecure: bool = False  # plaintext on a non-loopback address (--allow-insecure-engine)


def _check_transport(config: EngineServerConfig) -> None:
    """The engine API carries every prompt's token ids and takes no API keys: off this
    machine it needs TLS (better mTLS), unless the operator says otherwise."""
    if config.tls is not None or is_loopback(config.address):
        return
    if not config.allow_insecure:
        raise ConfigError(
            f"the engine API would listen on {config.address} without TLS: give "
            "--tls-cert-file/--tls-key-file (and --tls-client-ca-file), bind a loopback "
            "address, or pass --allow-insecure-engine"
        )
    logger.warning(
        "engine API listening without TLS on a non-loopback address (--allow-insecure-engine)",
        extra={"address": config.address},
    )


class EngineServer:
    """One gRPC server for one engine. `start()` answers health (NOT_SERVING) at once;
    `attach_engine()` makes it serve, so a model can load while probes get answers."""

    def __init__(self, config: EngineServerConfig) -> None:
        self.config = config
        self.tls = ServerTLS(config.tls) if config.tls is not None else None
        _check_transport(config)
        if config.engine_stall_timeout_s < 0:
            raise ConfigError(
                f"--engine-stall-timeout must be >= 0 (0: off), got {config.engine_stall_timeout_s}"
            )
        self.server = create_server(config.max_message_bytes, [WireGuard()])
        services = [ENGINE_SERVICE, VLLM_ENGINE_SERVICE]
        self.health = HealthReporter(self.server, services)
        self.metrics = EngineServiceMetrics()
        self.servicer = EngineServicer(self.health, config.max_inflight_requests, self.metrics)
        engine_pb2_grpc.add_EngineServiceServicer_to_server(self.servicer, self.server)
        # vLLM's engine protocol on the same port, sharing the in-flight request table.
        self.vllm_servicer = VllmEngineServicer(self.servicer.requests, self.metrics)
        self.vllm_servicer.health = self.health
        vllm_pb2_grpc.add_VllmEngineServicer_to_server(self.vllm_servicer, self.server)
        enable_reflection(self.server, services)
        self.port = 0
        self.metrics_endpoint: MetricsEndpoint | None = None
        if config.metrics_address is not None:
            self.metrics_endpoint = MetricsEndpoint(
                self.metrics.registry, config.metrics_address, config.metrics_name_prefix
            )
        self.engine_dead = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.watchdog: EngineWatchdog | None = None

    @property
    def engine(self) -> AsyncLLMEngine | None:
        return self.servicer.engine

    async def start(self) -> int:
        """Starts listening; returns the bound port."""
        credentials = self.tls.credentials() if self.tls is not None else None
        self.port = bind(self.server, self.config.address, credentials)
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.start()
        await self.health.set_serving(False, "loading")
        await self.server.start()
        logger.info(
            "engine service listening",
            extra={
                "address": self.config.address,
                "port": self.port,
                "tls": "mtls" if self.tls and self.tls.mutual else "tls" if self.tls else "off",
            },
        )
        return self.port

    def reload(self) -> None:
        """SIGHUP: the TLS certificate again (live streams keep going)."""
        if self.tls is not None:
            self.tls.reload()

    async def attach_engine(self, engine: AsyncLLMEngine) -> None:
        config = await engine.get_engine_config()
        self.servicer.model_info = model_info_from_config(config)
        self.servicer.model_name = config.model_config.served_model_name
        self.servicer.engine = engine
        self.vllm_servicer.attach(engine, config)
        self.metrics.attach_engine(engine.metrics_registry)
        await self.health.set_serving(not engine.errored, "engine ready")
        self._tasks.append(asyncio.create_task(self._watch_engine(engine)))
        if self.config.engine_stall_timeout_s > 0:
            loop = asyncio.get_running_loop()

            def on_change(stalled: bool, seconds: float) -> None:  # the watchdog's thread
                asyncio.run_coroutine_threadsafe(self._on_stall(engine, stalled, seconds), loop)

            self.watchdog = EngineWatchdog(
                engine, self.config.engine_stall_timeout_s, on_change
            ).start()
        if self.config.log_stats_interval_s > 0:
            interval = self.config.log_stats_interval_s
            self._tasks.append(asyncio.create_task(self._log_stats_every(engine, interval)))

    async def _watch_engine(self, engine: AsyncLLMEngine) -> None:
        """A dead engine turns health NOT_SERVING (the process should be restarted)."""
        while not engine.errored:
            await asyncio.sleep(_ENGINE_WATCH_INTERVAL_S)
        await self.health.set_serving(False, f"engine dead: {engine.dead_error}")
        self.engine_dead.set()

    async def _on_stall(self, engine: AsyncLLMEngine, stalled: bool, seconds: float) -> None:
        """NOT_SERVING while a step is stuck; SERVING again once steps return (unless the
        engine died meanwhile; a draining server stays NOT_SERVING regardless)."""
        self.servicer.stalled_s = seconds if stalled else 0.0
        if stalled:
            await self.health.set_serving(False, f"engine step stalled for {seconds:.1f} s")
        elif not engine.errored:
            await self.health.set_serving(True, "engine steps returned")

    async def _log_stats_every(self, engine: AsyncLLMEngine, interval: float) -> None:
        """The engine's stats line (throughput, running / waiting, KV-cache use) every
        `interval` seconds (repeated idle lines at DEBUG level)."""
        while not engine.errored:
            await asyncio.sleep(interval)
            with contextlib.suppress(EngineDeadError):
                await engine.do_log_stats()

    async def stop(self, grace: float | None = None) -> None:
        """Drains: NOT_SERVING at once and new requests refused (UNAVAILABLE, with the
        migrate metadata on our API), while health keeps answering; in-flight streams get
        `grace` seconds to finish, then are handed back (UNAVAILABLE with the migrate
        metadata on our API; aborted on vLLM's, whose gateway retries), their blocks freed."""
        grace = self.config.shutdown_grace_s if grace is None else grace
        self.servicer.draining = True
        await self.health.shutdown()
        try:
            await self._wait_for_streams(grace)
            await self._hand_back()
            self.servicer.end_stream_calls()  # GenerateStream calls end with their requests
            await self.server.stop(_HAND_BACK_MARGIN_S)
        finally:
            for task in self._tasks:
                task.cancel()
            if self.watchdog is not None:
                self.watchdog.stop()
            if self.metrics_endpoint is not None:
                await self.metrics_endpoint.stop()
        logger.info("engine service stopped", extra={"port": self.port})

    async def _wait_for_streams(self, grace: float) -> None:
        """Until no request is in flight, or `grace` seconds have passed."""
        deadline = time.monotonic() + grace
        while len(self.servicer.requests) and time.monotonic() < deadline:
            await asyncio.sleep(min(_DRAIN_POLL_S, max(0.0, deadline - time.monotonic())))

    async def _hand_back(self) -> None:
        live = [rid for rid, _ in self.servicer.requests.items()]
        if live and self.engine is not None:
            logger.info("drain: handing back in-flight requests", extra={"count": len(live)})
            self.servicer.hand_back(live)
            await self.engine.abort(live)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()
