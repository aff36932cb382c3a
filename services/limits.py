"""The live requests of one server, with its admission limit.

Admitting a request checks, in order: its id is not live here (ALREADY_EXISTS), and fewer
than `max_requests` are in flight (RESOURCE_EXHAUSTED: the client should back off).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

import grpc

from services.errors import ServiceError

T = TypeVar("T")


class RequestRegistry(Generic[T]):
    """request id -> what the server keeps for it while the request is in flight."""

    def __init__(self, max_requests: int) -> None:
        if max_requests < 1:
            raise ValueError(f"max_inflight_requests must be >= 1, got {max_requests}.")
        self.max_requests = max_requests
        self._live: dict[str, T] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def get(self, request_id: str) -> T | None:
        return self._live.get(request_id)

    def items(self) -> list[tuple[str, T]]:
        return list(self._live.items())

    @contextmanager
    def admit(self, request_id: str, value: T) -> Iterator[T]:
        """Holds `request_id` for the duration of the `with` block."""
        if request_id in self._live:
            raise ServiceError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {request_id!r} is already in use by a live request.",
            )
        if len(self._live) >= self.max_requests:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server's queue is full: {len(self._live)} requests in flight "
                f"(max_inflight_requests={self.max_requests}); retry later.",
            )
        self._live[request_id] = value
        try:
            yield value
        finally:
            del self._live[request_id]
