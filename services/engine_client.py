"""The tokenizer service's link to its engine service: one channel, a background health
poll, the engine's `ModelInfo`, and the translation of the engine's errors.

Reachability drives the tokenizer service's own health: NOT_SERVING as soon as a call or a
poll finds the engine unreachable, SERVING again once a poll finds it SERVING. The channel
reconnects with a short backoff, so a restarted engine is found within about a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.v1 import common_pb2, engine_pb2_grpc
from services.errors import ServiceError, engine_call_error, engine_unreachable
from services.grpc_server import DEFAULT_MAX_MESSAGE_BYTES, ENGINE_SERVICE

logger = logging.getLogger("services.engine_client")

_CHECK_TIMEOUT_S = 1.0

OnHealthChange = Callable[[bool, str], Awaitable[None]]


class EngineBackend:
    def __init__(
        self,
        address: str,
        on_health_change: OnHealthChange,
        *,
        poll_interval_s: float = 1.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        extra_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        """`credentials` (TLS / mTLS to the engine) and `extra_options` (e.g. the TLS
        name override) come from `services.tls.EngineLinkTLS`; None: plaintext."""
        self.address = address
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            *extra_options,
        ]
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self.channel = grpc.aio.secure_channel(address, credentials, options=options)
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        self._health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.model_info: common_pb2.ModelInfo | None = None
        self.available = False
        self._on_health_change = on_health_change
        self._poll_interval_s = poll_interval_s
        self._poke = asyncio.Event()
        self._poll_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._poll_task = asyncio.create_task(self._poll_loop())

    async def close(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
        await self.channel.close()

    # ---- health ---------------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        while True:
            await self._check()
            self._poke.clear()
            # asyncio.TimeoutError, not TimeoutError: they differ before Python 3.11.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._poke.wait(), self._poll_interval_s)

    async def _check(self) -> None:
        try:
            reply = await self._health_stub.Check(
                health_pb2.HealthCheckRequest(service=ENGINE_SERVICE), timeout=_CHECK_TIMEOUT_S
            )
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            reason = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            if serving and (self.model_info is None or not self.available):
                # (Re)connected: the engine may have restarted with another configuration.
                self.model_info = await self.stub.GetModelInfo(
                    common_pb2.GetModelInfoRequest(), timeout=_CHECK_TIMEOUT_S
                )
        except grpc.aio.AioRpcError as exc:
            serving, reason = False, f"{exc.code().name}: {exc.details()}"
        await self._set_available(serving, reason)

    async def _set_available(self, available: bool, reason: str) -> None:
        if available == self.available:
            return
        self.available = available
        logger.info(
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

    async def translate(self, exc: grpc.aio.AioRpcError) -> ServiceError:
        """The error for our client; an unreachable engine also turns our health
        NOT_SERVING at once (the poll turns it back)."""
        if engine_unreachable(exc):
            await self._set_available(False, f"{exc.code().name}: {exc.details()}")
            self._poke.set()
        return engine_call_error(exc, self.address)
