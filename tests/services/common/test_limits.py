"""The per-tenant limits on a fake clock: the token bucket (burst = one second's worth),
retry-after hints, and stream slots."""

from __future__ import annotations

import pytest

from services.common.limits import STREAM_RETRY_AFTER_MS, RateLimited, TenantLimits, TokenBucket


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_bursts_one_second_then_refills_at_the_rate():
    clock = Clock()
    bucket = TokenBucket(4.0, clock)
    assert [bucket.take() for _ in range(4)] == [0.0] * 4  # a burst of rps tokens
    assert bucket.take() == pytest.approx(0.25)  # the next token in 1 / rate
    clock.now += 0.25
    assert bucket.take() == 0.0
    clock.now += 10.0  # idle for long: still at most one second's worth
    assert [bucket.take() for _ in range(5)][-1] > 0


def test_a_slow_rate_still_allows_one_request():
    clock = Clock()
    bucket = TokenBucket(0.5, clock)  # one every two seconds
    assert bucket.take() == 0.0
    assert bucket.take() == pytest.approx(2.0)
    clock.now += 2.0
    assert bucket.take() == 0.0


def test_rate_limit_is_per_tenant_with_a_retry_hint():
    clock = Clock()
    limits = TenantLimits(clock)
    limits.check_rate("a", 1.0)
    with pytest.raises(RateLimited) as info:
        limits.check_rate("a", 1.0)
    assert info.value.retry_after_ms == 1001 and "rate limit of 1 requests" in info.value.message
    limits.check_rate("b", 1.0)  # another tenant has its own bucket
    limits.check_rate("c", None)  # no limit
    clock.now += 1.0
    limits.check_rate("a", 1.0)


def test_stream_slots():
    limits = TenantLimits(Clock())
    limits.acquire_stream("a", 2)
    limits.acquire_stream("a", 2)
    with pytest.raises(RateLimited) as info:
        limits.acquire_stream("a", 2)
    assert info.value.retry_after_ms == STREAM_RETRY_AFTER_MS
    limits.acquire_stream("b", 2)
    limits.release_stream("a")
    limits.acquire_stream("a", 2)
    assert (limits.num_streams("a"), limits.num_streams("b")) == (2, 1)
    for tenant in ("a", "a", "b"):
        limits.release_stream(tenant)
    assert limits.num_streams("a") == limits.num_streams("b") == 0
    with pytest.raises(KeyError):
        limits.release_stream("a")
