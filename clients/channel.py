"""Channels (plaintext, TLS or mutual TLS; with an API key or without), deadlines and the
retry policy, shared by both clients.

Retry: a call that fails with UNAVAILABLE (server not up yet, engine still loading, a
restart) is tried again after a backoff, up to `RetryPolicy.max_attempts` times and never
past the call's deadline. `Generate` is retried only until its first message has arrived:
once a delta has been handed to the caller, a failure is raised, never replayed.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from clients.auth import ApiKeyInterceptor, aio_interceptors

DEFAULT_ADDRESS = "localhost:50051"
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # the servers' default limit

Pem = bytes | str | os.PathLike  # PEM bytes, PEM text, or the path of a PEM file


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter for UNAVAILABLE: waits initial_backoff_s, then
    × multiplier per attempt up to max_backoff_s. `max_attempts=1` turns retries off."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2  # each wait is scaled by a random factor in [1 - jitter, 1 + jitter]

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1:
            raise ValueError("backoffs must be >= 0 and the multiplier >= 1")

    def backoff(self, code: grpc.StatusCode, attempt: int, deadline: Deadline) -> float | None:
        """Seconds to wait before retrying after attempt number `attempt` (0-based) failed
        with `code`, or None when the failure is final."""
        if code != grpc.StatusCode.UNAVAILABLE or attempt + 1 >= self.max_attempts:
            return None
        wait = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**attempt)
        wait *= random.uniform(1 - self.jitter, 1 + self.jitter)
        remaining = deadline.remaining()
        return None if remaining is not None and wait >= remaining else wait


NO_RETRY = RetryPolicy(max_attempts=1)


class Deadline:
    """A call's deadline: `timeout` seconds from now (None: no deadline), shared by all its
    attempts."""

    __slots__ = ("expires_at",)

    def __init__(self, timeout: float | None) -> None:
        self.expires_at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        """Seconds left (at least a millisecond, so an expired deadline fails the call with
        DEADLINE_EXCEEDED), or None."""
        if self.expires_at is None:
            return None
        return max(self.expires_at - time.monotonic(), 1e-3)


def _read_pem(value: Pem | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    text = os.fspath(value)
    if text.lstrip().startswith("-----BEGIN"):
        return text.encode()
    with open(text, "rb") as f:
        return f.read()


@dataclass(frozen=True, slots=True)
class ChannelConfig:
    """Where and how to connect. TLS is on when `tls` is set or any certificate is given:
    `root_certificates` to verify the server (the system roots when None), `private_key` +
    `certificate_chain` for client authentication (mutual TLS)."""

    address: str = DEFAULT_ADDRESS
    tls: bool = False
    root_certificates: Pem | None = None
    private_key: Pem | None = None
    certificate_chain: Pem | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    options: tuple[tuple[str, Any], ...] = ()  # extra grpc channel arguments
    api_key: str | None = field(default=None, repr=False)  # sent as `authorization: Bearer`

    @property
    def secure(self) -> bool:
        certificates = (self.root_certificates, self.private_key, self.certificate_chain)
        return self.tls or any(c is not None for c in certificates)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem(self.root_certificates),
            private_key=_read_pem(self.private_key),
            certificate_chain=_read_pem(self.certificate_chain),
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            # Reconnect quickly once a (re)starting server is up, so that retries find it.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
            *self.options,
        ]

    def sync_channel(self) -> grpc.Channel:
        if self.secure:
            channel = grpc.secure_channel(self.address, self.credentials(), self.channel_options())
        else:
            channel = grpc.insecure_channel(self.address, self.channel_options())
        if self.api_key:
            return grpc.intercept_channel(channel, ApiKeyInterceptor(self.api_key))
        return channel

    def aio_channel(self) -> grpc.aio.Channel:
        interceptors = aio_interceptors(self.api_key) if self.api_key else None
        if self.secure:
            return grpc.aio.secure_channel(
                self.address, self.credentials(), self.channel_options(), interceptors=interceptors
            )
        return grpc.aio.insecure_channel(
            self.address, self.channel_options(), interceptors=interceptors
        )
