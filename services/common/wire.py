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
from dataclasses import dataclass
from typing import Any

import grpc

logger = logging.getLogger("services.common.wire")

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
    """Parses requests itself so that bytes that are not the message end the call with
    INVALID_ARGUMENT: a unary request before the handler runs, each message of a request
    stream (reflection) as the handler reads it."""

    def __init__(self, warn_interval_s: float = _DEFAULT_WARN_INTERVAL_S) -> None:
        self.warning = RateLimitedWarning(warn_interval_s)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        if handler.request_streaming:
            return self._parsing_stream(handler, handler_call_details.method)
        return self._parsing(handler, handler_call_details.method)

    async def _reject(
        self, context: grpc.aio.ServicerContext, method: str, num_bytes: int, error: str
    ) -> None:
        self.warning.warn(
            "malformed request bytes rejected", method=method, num_bytes=num_bytes, error=error
        )
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request is not a valid message for {method} "
            f"({num_bytes} bytes that do not parse)",
        )

    def _parsing_stream(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """gRPC parses each streamed message as the handler reads it: a parser that returns
        a `_Malformed` marker instead of raising, and a request iterator that ends the call
        when it meets one."""
        deserialize = handler.request_deserializer

        def tolerant(raw: bytes) -> Any:
            try:
                return deserialize(raw)
            except Exception as exc:
                return _Malformed(len(raw), type(exc).__name__)

        async def checked(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for message in requests:
                if isinstance(message, _Malformed):
                    await self._reject(context, method, message.num_bytes, message.error)
                yield message

        def feed(raw_requests: Any, context: grpc.aio.ServicerContext) -> Any:
            return checked(raw_requests, context)

        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.stream_unary_rpc_method_handler
        )
        behaviour = handler.stream_stream if handler.response_streaming else handler.stream_unary
        wrapped = _streaming if handler.response_streaming else _unary
        return make(
            wrapped(behaviour, _as_async(feed)),
            request_deserializer=tolerant,
            response_serializer=handler.response_serializer,
        )

    def _parsing(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        deserialize = handler.request_deserializer

        async def parse(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                return deserialize(raw)
            except Exception as exc:  # DecodeError, or whatever a custom parser raises
                await self._reject(context, method, len(raw), type(exc).__name__)

        if not handler.response_streaming:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary, parse),
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_stream_rpc_method_handler(
            _streaming(handler.unary_stream, parse),
            response_serializer=handler.response_serializer,
        )


@dataclass(frozen=True, slots=True)
class _Malformed:
    """What the tolerant parser of a request stream yields for bytes that do not parse."""

    num_bytes: int
    error: str


Parse = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


def _as_async(function: Callable[..., Any]) -> Parse:
    async def call(value: Any, context: grpc.aio.ServicerContext) -> Any:
        return function(value, context)

    return call


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
