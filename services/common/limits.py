"""The live requests of one server, with its admission limit, and the per-tenant limits.

Admitting a request checks, in order: its id is not live here (ALREADY_EXISTS), and fewer
than `max_requests` are in flight (RESOURCE_EXHAUSTED: the client should back off).
A tenant (`services.security.auth`) may also have a rate (`rps`, a token bucket holding one
second's worth) and a number of concurrent streams (`max_streams`); over either →
RESOURCE_EXHAUSTED with a `retry-after-ms` hint (`RateLimited`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

import grpc

from services.common.errors import ServiceError

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
    def admit(self, request_id: str, value: T, shown_id: str | None = None) -> Iterator[T]:
        """Holds `request_id` for the duration of the `with` block; `shown_id` is the id
        the caller knows (without the tenant's scope), for the error message."""
        if request_id in self._live:
            raise ServiceError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {shown_id or request_id!r} is already in use by a live request.",
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


class RateLimited(ServiceError):
    """RESOURCE_EXHAUSTED with a hint: the client may retry after `retry_after_ms`."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.retry_after_ms = max(1, retry_after_ms)


class TokenBucket:
    """`rate` tokens per second, holding at most one second's worth (at least one token)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        self.rate = rate
        self.capacity = max(rate, 1.0)
        self._clock = clock
        self._tokens = self.capacity
        self._updated = clock()

    def take(self) -> float:
        """Takes a token: 0.0 when there was one, else the seconds until there is."""
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._updated) * self.rate)
        self._updated = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate


# A tenant at its stream limit learns nothing about when a stream ends: a short hint.
STREAM_RETRY_AFTER_MS = 250


class TenantLimits:
    """Per-tenant requests per second and concurrent streams (`services.security.auth.Tenant`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._streams: dict[str, int] = {}

    def num_streams(self, tenant: str) -> int:
        return self._streams.get(tenant, 0)

    def check_rate(self, tenant: str, rps: float | None) -> None:
        """Raises RateLimited when the tenant has no token left this second."""
        if rps is None:
            return
        bucket = self._buckets.get(tenant)
        if bucket is None or bucket.rate != rps:
            bucket = self._buckets[tenant] = TokenBucket(rps, self._clock)
        wait = bucket.take()
        if wait > 0:
            raise RateLimited(
                f"tenant {tenant!r} is over its rate limit of {rps:g} requests per second",
                retry_after_ms=int(wait * 1000) + 1,
            )

    def acquire_stream(self, tenant: str, max_streams: int | None) -> None:
        """Takes one of the tenant's `max_streams` (RateLimited when none is left); give
        it back with `release_stream`."""
        count = self._streams.get(tenant, 0)
        if max_streams is not None and count >= max_streams:
            raise RateLimited(
                f"tenant {tenant!r} has {count} streams open, its limit "
                f"(max_streams={max_streams}); retry when one ends",
                retry_after_ms=STREAM_RETRY_AFTER_MS,
            )
        self._streams[tenant] = count + 1

    def release_stream(self, tenant: str) -> None:
        remaining = self._streams[tenant] - 1
        assert remaining >= 0, f"tenant {tenant!r}: a stream released twice"
        if remaining:
            self._streams[tenant] = remaining
        else:
            del self._streams[tenant]
