"""Typed exceptions for the statuses pagedserve's API returns (docs/grpc.md, "Status codes").

PagedServeError(code, message)      every failed call; `code` is the grpc.StatusCode
├── InvalidArgumentError            (also a ValueError) a bad parameter; the message
│                                   names the field: "sampling_params.top_p must be ..."
├── NotFoundError
├── AlreadyExistsError              the request_id belongs to a live request
├── ResourceExhaustedError          the server is full (retry later), or the prompt can
│                                   never fit the KV cache
├── UnavailableError                (also a ConnectionError) the server or its engine is
│                                   unreachable or still loading
├── DeadlineExceededError           (also a TimeoutError) the call's `timeout` passed
├── CancelledError                  the server cancelled the call
├── AbortedError                    an Encode request was aborted
├── UnimplementedError
└── InternalError
"""

from __future__ import annotations

import grpc


class PagedServeError(Exception):
    """A call that ended with a gRPC status other than OK."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class InvalidArgumentError(PagedServeError, ValueError):
    pass


class NotFoundError(PagedServeError):
    pass


class AlreadyExistsError(PagedServeError):
    pass


class ResourceExhaustedError(PagedServeError):
    pass


class UnavailableError(PagedServeError, ConnectionError):
    pass


class DeadlineExceededError(PagedServeError, TimeoutError):
    pass


class CancelledError(PagedServeError):
    pass


class AbortedError(PagedServeError):
    pass


class UnimplementedError(PagedServeError):
    pass


class InternalError(PagedServeError):
    pass


_BY_CODE: dict[grpc.StatusCode, type[PagedServeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.INTERNAL: InternalError,
}


def error_for(code: grpc.StatusCode, message: str) -> PagedServeError:
    """The exception for a status `code` (PagedServeError itself for codes without a class)."""
    return _BY_CODE.get(code, PagedServeError)(code, message)


def from_rpc_error(exc: grpc.RpcError) -> PagedServeError:
    """The typed exception for a failed call (sync `grpc.RpcError` or `grpc.aio.AioRpcError`)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else None
    code = code or grpc.StatusCode.UNKNOWN
    return error_for(code, details or code.name)
