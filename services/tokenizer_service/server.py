"""The tokenizer service's gRPC server: the public API
(`services.tokenizer_service.generation_servicer`),
standard health (NOT_SERVING until an engine replica answers, and while none does),
reflection, `/metrics`, and a graceful stop that aborts streams still running after the
grace period. Its engine replicas and the routing among them:
`services/tokenizer_service/replicas/pool.py`.
"""

from __future__ import annotations

import asyncio
import logging

from pagedserve.v1 import generation_pb2_grpc
from services.common.errors import ConfigError
from services.common.grpc_server import (
    TEXT_GENERATION_SERVICE,
    HealthReporter,
    bind,
    create_server,
    enable_reflection,
)
from services.common.metrics import MetricsEndpoint
from services.common.wire import WireGuard
from services.security.auth import ApiKeys
from services.security.tenancy import TenantGuard
from services.security.tls import ServerTLS
from services.tokenizer_service.config import TokenizerServerConfig
from services.tokenizer_service.generation_servicer import TextGenerationServicer
from services.tokenizer_service.model_files import TextModelFiles
from services.tokenizer_service.replicas.pool import EnginePool, Resolver, resolve_all

logger = logging.getLogger("services.tokenizer")


class TokenizerServer:
    """The tokenizer service's server, in front of one or more engine replicas."""

    def __init__(
        self,
        config: TokenizerServerConfig,
        files: TextModelFiles,
        resolver: Resolver = resolve_all,
    ) -> None:
        """`resolver` looks up `dns:///` engine names (the system resolver by default)."""
        self.config = config
        self.tls = ServerTLS(config.tls) if config.tls is not None else None
        keys = ApiKeys.from_file(config.api_key_file) if config.api_key_file else None
        self.guard = TenantGuard(keys) if keys is not None else None
        interceptors = [self.guard, WireGuard()] if self.guard is not None else [WireGuard()]
        self.server = create_server(config.max_message_bytes, interceptors, config.reuse_port)
        self.health = HealthReporter(self.server, [TEXT_GENERATION_SERVICE])
        engine_tls = config.engine_tls
        self.backend = EnginePool(
            config.engine_address,
            self._on_engine_health,
            poll_interval_s=config.engine_poll_interval_s,
            max_message_bytes=config.max_message_bytes,
            dns_refresh_s=config.engine_dns_refresh_s,
            prefix_blocks=config.route_prefix_blocks,
            max_queue_imbalance=config.route_max_queue_imbalance,
            policy=config.route_policy,
            stall_timeout_s=config.engine_stall_timeout_s,
            multiplex=config.engine_multiplex,
            resolver=resolver,
            credentials=engine_tls.credentials() if engine_tls.enabled else None,
            channel_options=engine_tls.channel_options(),
        )
        self.servicer = TextGenerationServicer(files, self.backend, config)
        self.servicer.rpc_metrics.attach_replicas(lambda: list(self.backend.replicas.values()))
        if self.guard is not None:
            self.guard.attach_metrics(self.servicer.rpc_metrics.registry)
        generation_pb2_grpc.add_TextGenerationServiceServicer_to_server(self.servicer, self.server)
        enable_reflection(self.server, [TEXT_GENERATION_SERVICE])
        self.port = 0
        self.metrics_endpoint: MetricsEndpoint | None = None
        if config.metrics_address is not None:
            self.metrics_endpoint = MetricsEndpoint(
                self.servicer.rpc_metrics.registry,
                config.metrics_address,
                config.metrics_name_prefix,
            )

    async def _on_engine_health(self, available: bool, reason: str) -> None:
        self.servicer.serving = available and not self.health.shutting_down
        self.servicer.rpc_metrics.engine_backend_up.set(1 if available else 0)
        await self.health.set_serving(available, f"engine {reason}")

    async def start(self) -> int:
        """Starts listening (and polling the engine); returns the bound port."""
        credentials = self.tls.credentials() if self.tls is not None else None
        self.port = bind(self.server, self.config.address, credentials)
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.start()
        await self.health.set_serving(False, "waiting for the engine")
        await self.server.start()
        self.backend.start()
        logger.info(
            "tokenizer service listening",
            extra={
                "address": self.config.address,
                "port": self.port,
                "engine_address": self.config.engine_address,
                "tls": "mtls" if self.tls and self.tls.mutual else "tls" if self.tls else "off",
                "api_keys": len(self.guard.keys) if self.guard is not None else 0,
            },
        )
        return self.port

    def reload(self) -> None:
        """SIGHUP: the TLS certificate, the engine link's client certificate and CA, and
        the API key file again (live streams keep going; a file that cannot be read keeps
        what was loaded, with one error line)."""
        if self.tls is not None:
            self.tls.reload()
        engine_tls = self.config.engine_tls
        if engine_tls.enabled:
            try:
                credentials = engine_tls.credentials()
            except ConfigError as exc:
                logger.error("engine tls reload failed; keeping the current certificate: %s", exc)
            else:
                self.backend.replace_credentials(credentials)
                logger.info("engine tls certificates reloaded")
        if self.guard is not None and self.config.api_key_file:
            try:
                self.guard.keys = ApiKeys.from_file(self.config.api_key_file)
            except ValueError as exc:
                logger.error("api key reload failed; keeping the current keys: %s", exc)
            else:
                logger.info("api keys reloaded", extra={"api_keys": len(self.guard.keys)})

    async def stop(self, grace: float | None = None) -> None:
        """Stops taking requests; in-flight streams get `grace` seconds, then end with
        finish_reason ABORT."""
        grace = self.config.shutdown_grace_s if grace is None else grace
        self.servicer.serving = False
        await self.health.shutdown()
        aborter = asyncio.create_task(self._abort_all_after(grace * 0.8))
        try:
            await self.server.stop(grace)
        finally:
            aborter.cancel()
            await self.backend.close()
            if self.metrics_endpoint is not None:
                await self.metrics_endpoint.stop()
        logger.info("tokenizer service stopped", extra={"port": self.port})

    async def _abort_all_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if len(self.servicer.requests):
            logger.info(
                "shutdown: aborting in-flight requests",
                extra={"count": len(self.servicer.requests)},
            )
        self.servicer.abort_all()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()
