"""What both servers share: a grpc.aio server with its limits, the standard health service,
reflection, trace-context metadata and waiting for SIGTERM / SIGINT.

Health follows one rule on both servers: NOT_SERVING until the backend is ready (the model
loaded, or the engine service reachable), SERVING while it stays so, NOT_SERVING for good
once shutdown begins. The overall entry ("") and each API service carry the same status.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedserve.v1 import engine_pb2, generation_pb2
from services.common.reflection import enable_reflection  # noqa: F401  (both servers import it here)

logger = logging.getLogger("services.server")

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
TEXT_GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name[
    "TextGenerationService"
].full_name
TRACE_METADATA_KEYS = ("traceparent", "tracestate")


def create_server(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    reuse_port: bool = False,
) -> grpc.aio.Server:
    """A grpc.aio server whose messages may be up to `max_message_bytes` each way;
    `reuse_port`: it shares its port with the other processes that ask the same
    (`pagedserve tokenizer --workers`)."""
    if max_message_bytes < 1024:
        raise ValueError(f"max_message_bytes must be >= 1024, got {max_message_bytes}.")
    return grpc.aio.server(
        interceptors=list(interceptors),
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # Unless asked to share, fail loudly when the port is taken.
            ("grpc.so_reuseport", 1 if reuse_port else 0),
        ],
    )


def bind(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None
) -> int:
    """Binds `address` (host:port; port 0 picks a free one), with TLS when `credentials`
    are given, and returns the port."""
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # grpc raises RuntimeError when the bind fails
        raise OSError(f"cannot listen on {address}: {exc}") from exc
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return port


class HealthReporter:
    """The standard `grpc.health.v1.Health` service of one server."""

    def __init__(self, server: grpc.aio.Server, service_names: Iterable[str]) -> None:
        self._servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        self._names = [health.OVERALL_HEALTH, *service_names]
        self.serving = False
        self.shutting_down = False

    async def set_serving(self, serving: bool, reason: str = "") -> None:
        """Sets every entry; call once with False before the server starts (the stock
        servicer starts out SERVING)."""
        if self.shutting_down:
            return
        if serving != self.serving:
            logger.info(
                "health %s", "SERVING" if serving else "NOT_SERVING", extra={"reason": reason}
            )
        self.serving = serving
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in self._names:
            await self._servicer.set(name, status)

    async def shutdown(self) -> None:
        """NOT_SERVING from now on (load balancers stop sending new requests)."""
        self.serving = False
        self.shutting_down = True
        await self._servicer.enter_graceful_shutdown()

    @property
    def status_name(self) -> str:
        return "SERVING" if self.serving else "NOT_SERVING"


def trace_headers(
    request_headers: Mapping[str, str], context: grpc.aio.ServicerContext
) -> dict[str, str]:
    """The request's `trace_headers`, with W3C trace context from the metadata winning."""
    headers = dict(request_headers)
    for key, value in context.invocation_metadata() or ():
        if key in TRACE_METADATA_KEYS:
            headers[key] = value if isinstance(value, str) else value.decode()
    return headers


def trace_metadata(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The W3C trace-context entries of `headers`, as metadata for an outgoing call."""
    return tuple((key, headers[key]) for key in TRACE_METADATA_KEYS if key in headers)


async def wait_for_signal(
    signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
) -> signal.Signals:
    """Waits (in the main thread's event loop) until one of `signals` arrives."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[signal.Signals] = loop.create_future()
    signals = list(signals)
    for sig in signals:
        loop.add_signal_handler(sig, lambda s=sig: received.done() or received.set_result(s))
    try:
        return await received
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def on_sighup(callback: Callable[[], object]) -> Callable[[], None]:
    """Calls `callback` in the running loop on each SIGHUP (certificate reload); returns
    the function that removes the handler."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, callback)
    return lambda: loop.remove_signal_handler(signal.SIGHUP)
