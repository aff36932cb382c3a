"""`Client` and `AsyncClient` are one API over two transports (`clients/calls.py` holds the
methods once): the same methods and arguments, the same request on the wire for the same
arguments, the same retry policy per method; only awaiting differs."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from clients import AsyncClient, Client, RetryPolicy, UnavailableError
from tests.clients.fake_server import FakeService

FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05)
KWARGS = dict(
    messages=[{"role": "user", "content": "hi"}],
    request_id="same",
    priority=3,
    trace_headers={"traceparent": "00-ab-cd-01"},
    lora_name="sql",
    add_generation_prompt=True,
    temperature=0.5,
    stop="x",
    json_schema={"type": "object"},
)


def _public(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(cls, callable)
        if not name.startswith("_") and name != "close"
    }


def test_both_clients_have_the_same_methods_and_arguments():
    sync, aio = _public(Client), _public(AsyncClient)
    assert sorted(sync) == sorted(aio)
    assert {"generate", "encode", "abort", "load_lora_adapter"} <= set(sync)
    for name in sync:
        assert sync[name].parameters == aio[name].parameters, name
        # Every method but generate (it returns the stream at once) is awaited on AsyncClient.
        assert inspect.iscoroutinefunction(getattr(AsyncClient, name)) == (name != "generate")
        assert not inspect.iscoroutinefunction(getattr(Client, name))
    assert sync["encode"].return_annotation == "list[list[float]]"


def test_the_same_arguments_send_the_same_request(fake):
    service = FakeService()
    address = fake(service)
    with Client(address) as client:
        sync_text = client.generate_text(**KWARGS).text

    async def main() -> str:
        async with AsyncClient(address) as client:
            return (await client.generate_text(**KWARGS)).text

    assert asyncio.run(main()) == sync_text == "t7t8t9"
    sent, async_sent = service.requests
    assert sent == async_sent
    assert sent.chat.messages[0].content == "hi" and sent.sampling_params.stop == ["x"]
    assert sent.sampling_params.json_schema == '{"type": "object"}'


def test_each_method_keeps_its_retry_policy_on_both_clients(fake):
    # Tokenize is retried through UNAVAILABLE; Health reports at once.
    tokenize_sync, tokenize_async = FakeService(2), FakeService(2)
    health_sync, health_async = FakeService(1), FakeService(1)
    with Client(fake(tokenize_sync), retry=FAST) as client:
        assert client.tokenize("x").count == 2
    with Client(fake(health_sync), retry=FAST) as client, pytest.raises(UnavailableError):
        client.health()

    async def main() -> None:
        async with AsyncClient(fake(tokenize_async), retry=FAST) as client:
            assert (await client.tokenize("x")).count == 2
        async with AsyncClient(fake(health_async), retry=FAST) as client:
            with pytest.raises(UnavailableError):
                await client.health()

    asyncio.run(main())
    assert (tokenize_sync.num_calls, tokenize_async.num_calls) == (3, 3)
    assert (health_sync.num_calls, health_async.num_calls) == (1, 1)
