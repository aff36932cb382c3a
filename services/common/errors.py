"""Exceptions → gRPC status codes, in one place.

Servicer methods raise; the `rpc_method` decorator turns what they raise into a status with
a message that names the field (the engine's and our checks' messages already do):

    ServiceError(code, message)        our own checks (the code is chosen where it is raised)
    ValueError / TypeError             INVALID_ARGUMENT, except
        "... already in use" / "collides"      ALREADY_EXISTS (duplicate request id)
        "... could never ..." / "queue is full" RESOURCE_EXHAUSTED
    NotImplementedError                UNIMPLEMENTED
    EngineDeadError                    UNAVAILABLE (the engine process must be restarted)
    asyncio.CancelledError             CANCELLED (when our side cancelled, not the client)
    TimeoutError                       DEADLINE_EXCEEDED
    grpc.aio.AioRpcError               the upstream call's own code and message; from the
                                       engine service: see `engine_call_error`
    anything else                      INTERNAL
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from engine.api.errors import EngineDeadError
from services.common import tracing

logger = logging.getLogger("services.common.errors")

_ALREADY_EXISTS_MARKERS = ("already in use", "collides with a live request")
_RESOURCE_EXHAUSTED_MARKERS = ("could never", "queue is full")
_DEADLINE_SLACK_S = 0.05

F = TypeVar("F", bound=Callable[..., Any])


class ServiceError(Exception):
    """An error whose status code (and trailing metadata, if any) is decided where it is
    raised."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        trailing_metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailing_metadata = trailing_metadata


class ConfigError(ValueError):
    """A server cannot start as configured (a TLS or key file, an insecure bind): the
    command prints the message, without a traceback."""


def invalid_argument(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for `exc`."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or exc.code().name
    message = str(exc) or type(exc).__name__
    if isinstance(exc, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, f"the engine is dead: {message}"
    if isinstance(exc, ValueError | TypeError):
        if any(marker in message for marker in _ALREADY_EXISTS_MARKERS):
            return grpc.StatusCode.ALREADY_EXISTS, message
        if any(marker in message for marker in _RESOURCE_EXHAUSTED_MARKERS):
            return grpc.StatusCode.RESOURCE_EXHAUSTED, message
        return grpc.StatusCode.INVALID_ARGUMENT, message
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, message
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED, "the request was cancelled"
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline was exceeded"
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}): {message}"


def engine_unreachable(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a failed engine-service call means the engine is not there (rather than that
    it rejected the request): it never cancels a call itself except when going away."""
    return exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def engine_call_error(exc: grpc.aio.AioRpcError, address: str) -> ServiceError:
    """What the tokenizer service's client sees for a failed engine-service call: the
    engine's own status for a rejected request, UNAVAILABLE for an unreachable engine."""
    if engine_unreachable(exc):
        return ServiceError(
            grpc.StatusCode.UNAVAILABLE,
            f"the engine service at {address} is unavailable ({exc.code().name}: {exc.details()})",
        )
    return ServiceError(exc.code(), exc.details() or exc.code().name)


async def _abort(
    context: grpc.aio.ServicerContext,
    request: Any,
    code: grpc.StatusCode,
    message: str,
    trailing_metadata: tuple[tuple[str, str], ...] = (),
) -> None:
    """Ends the RPC with `code`, `message` and `trailing_metadata` (raises
    grpc.aio.AbortError)."""
    request_id = getattr(request, "request_id", "")
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("rpc failed", extra={"request_id": request_id, "code": code.name})
    else:
        logger.info(
            "rpc rejected: %s", message, extra={"request_id": request_id, "code": code.name}
        )
    await context.abort(code, message, trailing_metadata)


def _client_gone(exc: BaseException, context: grpc.aio.ServicerContext) -> bool:
    """True when gRPC itself cancelled the handler (client cancel, deadline, shutdown)."""
    return isinstance(exc, grpc.aio.AbortError) or (
        isinstance(exc, asyncio.CancelledError) and (context.cancelled() or context.done())
    )


def _final_status(exc: BaseException, context: grpc.aio.ServicerContext) -> tuple[Any, str]:
    """The status a call that raised `exc` ends with: what a `context.abort` in the method
    set, DEADLINE_EXCEEDED for a cancel once the deadline passed, else `status_for`."""
    if isinstance(exc, grpc.aio.AbortError):
        code = context.code()
        if not isinstance(code, grpc.StatusCode):
            code = next((c for c in grpc.StatusCode if c.value[0] == code), None)
        return code or grpc.StatusCode.UNKNOWN, context.details() or ""
    if isinstance(exc, asyncio.CancelledError):
        remaining = context.time_remaining()
        # gRPC's deadline timer may cancel the handler a little before the deadline by our
        # clock (seen: the public span said CANCELLED for a request that hit its deadline).
        if remaining is not None and remaining <= _DEADLINE_SLACK_S:
            return grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline was exceeded"
    return status_for(exc)


def rpc_method(method: F) -> F:
    """Wraps a servicer method (unary, or streaming with `context.write`): what it raises
    becomes a status. Streaming methods write rather than yield so that a cancelled client
    interrupts them at an `await`, where their `finally` blocks run at once.

    Each call runs inside its SERVER span (`services.common.tracing.rpc_span`, named
    `<SERVICE_NAME>/<method>` from the servicer's `SERVICE_NAME`), which ends with the
    call's status; the servicer's `rpc_metrics` (if not None) counts it by status code."""
    method_name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: Any) -> Any:
        code, message = grpc.StatusCode.OK, ""
        service = getattr(self, "SERVICE_NAME", type(self).__name__)
        with tracing.rpc_span(f"{service}/{method_name}", request, context) as span:
            try:
                return await method(self, request, context)
            except (Exception, asyncio.CancelledError) as exc:
                code, message = _final_status(exc, context)
                if _client_gone(exc, context):
                    raise
                metadata = exc.trailing_metadata if isinstance(exc, ServiceError) else ()
                await _abort(context, request, code, message, metadata)
            finally:
                tracing.end_rpc_span(span, code, message)
                rpc_metrics = getattr(self, "rpc_metrics", None)
                if rpc_metrics is not None:
                    rpc_metrics.count_rpc(method_name, code)

    return wrapper  # type: ignore[return-value]
