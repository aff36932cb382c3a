"""Retries of UNAVAILABLE (only before the first token, bounded, within the deadline) and TLS,
against a fake public API."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
import time

import grpc
import pytest

from clients import (
    NO_RETRY,
    AsyncClient,
    Client,
    DeadlineExceededError,
    RetryPolicy,
    UnavailableError,
)
from clients.channel import Deadline
from tests.clients.fake_server import FakeService, start_fake_server
from tests.services.processes import free_port

FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05)


def test_unavailable_before_the_first_token_is_retried(fake):
    service = FakeService(num_unavailable=2)
    with Client(fake(service), retry=FAST) as client:
        result = client.generate_text("hi")
    assert result.text == "t7t8t9" and result.finish_reasons == ["length"]
    assert service.num_calls == 3


def test_retries_are_bounded(fake):
    service = FakeService(num_unavailable=100)
    with Client(fake(service), retry=FAST) as client, pytest.raises(UnavailableError) as info:
        client.generate_text("hi")
    assert service.num_calls == FAST.max_attempts
    assert "still loading" in info.value.message


def test_no_retry_once_a_delta_was_yielded(fake):
    service = FakeService(fail_after_first=True)
    received = []
    with Client(fake(service), retry=FAST) as client, pytest.raises(UnavailableError):
        for delta in client.generate("hi"):
            received.append(delta.text)
    assert received == ["t7"] and service.num_calls == 1


def test_retries_stop_at_the_deadline(fake):
    """100 attempts allowed, but waits of at least 0.16 s (0.2 s less 20 % jitter) fit at
    most three times in 0.5 s: the deadline, not `max_attempts`, ends the retries. (How
    many fit depends on the machine's load; that no more than four are made does not.)"""
    service = FakeService(num_unavailable=100)
    slow = RetryPolicy(max_attempts=100, initial_backoff_s=0.2, max_backoff_s=0.2)
    # The last attempt ends UNAVAILABLE, or DEADLINE_EXCEEDED when it started with little
    # time left and the loaded machine answered late: either way, at the deadline.
    expected = (UnavailableError, DeadlineExceededError)
    with Client(fake(service), retry=slow) as client, pytest.raises(expected):
        client.generate_text("hi", timeout=0.5)
    assert 1 <= service.num_calls <= 4


def test_the_backoff_schedule_grows_to_its_cap_and_ends_at_the_deadline():
    """The waits between attempts, from the policy itself: exponential up to the cap, none
    after the last attempt or for a code other than UNAVAILABLE, and none that would end
    past the deadline (deadlines far from the waits, so no clock decides the outcome)."""
    unavailable = grpc.StatusCode.UNAVAILABLE
    policy = RetryPolicy(
        max_attempts=6, initial_backoff_s=1.0, max_backoff_s=5.0, multiplier=2.0, jitter=0.0
    )
    no_deadline, far, near = Deadline(None), Deadline(3600.0), Deadline(3.0)
    schedule = [policy.backoff(unavailable, attempt, no_deadline) for attempt in range(6)]
    assert schedule == [1.0, 2.0, 4.0, 5.0, 5.0, None]
    assert [policy.backoff(unavailable, a, far) for a in range(6)] == schedule
    assert policy.backoff(unavailable, 0, near) == 1.0
    assert policy.backoff(unavailable, 2, near) is None  # 4 s > the 3 s left
    assert policy.backoff(grpc.StatusCode.INTERNAL, 0, no_deadline) is None
    jittered = RetryPolicy(initial_backoff_s=1.0, jitter=0.2)
    waits = [jittered.backoff(unavailable, 0, no_deadline) for _ in range(200)]
    assert all(0.8 <= w <= 1.2 for w in waits) and len(set(waits)) > 1


def test_unary_calls_retry_but_health_does_not(fake):
    service = FakeService(num_unavailable=1)
    with Client(fake(service), retry=FAST) as client:
        assert client.tokenize("x").token_ids == [1, 2]
        assert service.num_calls == 2
        service.num_unavailable = 3
        with pytest.raises(UnavailableError):
            client.health()
        assert service.num_calls == 3


def test_a_server_that_comes_up_a_moment_later():
    port = free_port()
    service = FakeService()
    servers: list[grpc.Server] = []
    timer = threading.Timer(0.5, lambda: servers.append(start_fake_server(service, port)[0]))
    timer.start()
    # Waits of 0.05 s to 0.5 s for up to 60 s: however slowly the server starts under load.
    patient = RetryPolicy(max_attempts=200, initial_backoff_s=0.05, max_backoff_s=0.5)
    try:
        start = time.monotonic()
        with Client(f"127.0.0.1:{port}", retry=patient, timeout=60) as client:
            assert client.generate_text("hi").text == "t7t8t9"
        assert time.monotonic() - start >= 0.4
        assert service.num_calls == 1
    finally:
        timer.join()
        for server in servers:
            server.stop(0)


def test_async_client_retries_only_before_the_first_token(fake):
    flaky, dying = FakeService(num_unavailable=2), FakeService(fail_after_first=True)
    flaky_address, dying_address = fake(flaky), fake(dying)

    async def main() -> list[str]:
        async with AsyncClient(flaky_address, retry=FAST) as client:
            assert (await client.generate_text("hi")).text == "t7t8t9"
        received = []
        async with AsyncClient(dying_address, retry=FAST) as client:
            with pytest.raises(UnavailableError):
                async for delta in client.generate("hi"):
                    received.append(delta.text)
        return received

    assert asyncio.run(main()) == ["t7"]
    assert (flaky.num_calls, dying.num_calls) == (3, 1)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_with_a_self_signed_certificate(fake, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    credentials = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    address = fake(FakeService(), credentials=credentials).replace("127.0.0.1", "localhost")
    with Client(address, root_certificates=str(cert)) as client:
        assert client.generate_text("hi").text == "t7t8t9"
    with Client(address, root_certificates=cert.read_bytes(), tls=True) as client:
        assert client.tokenize("x").count == 2
    with (
        Client(address, retry=NO_RETRY, timeout=5) as plaintext,
        pytest.raises(UnavailableError),
    ):
        plaintext.generate_text("hi")
