"""Malformed request bytes → INVALID_ARGUMENT, on every unary-request RPC of a server.

grpc.aio parses a request with the method's `request_deserializer` before the servicer
runs; when that raises (protobuf's DecodeError on bytes that are not the message), the
call ends as UNKNOWN "Unexpected <error>" and gRPC logs an ERROR traceback, once per call,
so any client could fill the logs. `WireGuard` takes the parsing over: the handler gets
the raw bytes, parses them itself and ends a bad call with INVALID_ARGUMENT. Bad calls are
logged as at most one warning line per `warn_interval_s` (with the count since the last).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

logger = logging.getLogger("services.wire")

_DEFAULT_WARN_INTERVAL_S = 60.0


class RateLimitedWarning:
    """One warning line per `interval_s` at most; the others are counted into the next."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.num_total = 0
        self._num_suppressed = 0
        self._last = float("-inf")
        self._lock = threading.Lock()

    def warn(self, message: str, **fields: Any) -> bool:
        """Logs `message` unless one was logged within the interval; True if logged."""
        now = time.monotonic()
        with self._lock:
            self.num_total += 1
            if now - self._last < self.interval_s:
                self._num_suppressed += 1
                return False
            suppressed, self._num_suppressed, self._last = self._num_suppressed, 0, now
        logger.warning(message, extra={**fields, "num_suppressed": suppressed})
        return True


class WireGuard(grpc.aio.ServerInterceptor):
    """Parses unary requests itself so that bytes that are not the message end the call
    with INVALID_ARGUMENT (request-streaming methods, i.e. reflection, are left alone)."""

    def __init__(self, warn_interval_s: float = _DEFAULT_WARN_INTERVAL_S) -> None:
        self.warning = RateLimitedWarning(warn_interval_s)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        return self._parsing(handler, handler_call_details.method)

    def _parsing(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        deserialize = handler.request_deserializer
        warning = self.warning

        async def parse(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                return deserialize(raw)
            except Exception as exc:  # DecodeError, or whatever a custom parser raises
                warning.warn(
                    "malformed request bytes rejected",
                    method=method,
                    num_bytes=len(raw),
                    error=type(exc).__name__,
                )
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the request is not a valid message for {method} "
                    f"({len(raw)} bytes that do not parse)",
                )

        if not handler.response_streaming:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary, parse),
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_stream_rpc_method_handler(
            _streaming(handler.unary_stream, parse),
            response_serializer=handler.response_serializer,
        )


Parse = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]


def _unary(behaviour: Callable[..., Any], parse: Parse) -> Callable[..., Awaitable[Any]]:
    async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        result = behaviour(await parse(raw, context), context)
        return await result if inspect.isawaitable(result) else result

    return call


def _streaming(behaviour: Callable[..., Any], parse: Parse) -> Callable[..., Any]:
    """Keeps the kind of the wrapped behaviour: an async generator stays one (the health
    service's Watch); a coroutine that writes with `context.write` stays a coroutine."""
    if inspect.isasyncgenfunction(behaviour):

        async def generate(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in behaviour(await parse(raw, context), context):
                yield response

        return generate

    async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        result = behaviour(await parse(raw, context), context)
        return await result if inspect.isawaitable(result) else result

    return call
