"""A request id reused right after its stream ended, over per-request engine calls
(`engine_multiplex=False`; the multiplexed call's ordering: test_stream_mux.py).

A stop string ends the client's stream at the tokenizer service, which cancels the engine
call; the client asks again with the same request_id at once, and the tokenizer service
opens a new call on another HTTP/2 stream. gRPC orders nothing between the two calls: the
new one may reach the engine service before the cancellation of the old one, while the id is
still held there (replicas/cancelled_ids.py). On loopback the cancellation nearly always
wins, so `SlowToFreeServicer` makes the other order happen every time: it keeps a cancelled
call's id until a later call of the same id has been refused once, as an engine service to
which the cancellation arrives late. Real servers, the public API; every engine service
here (the session's ordinary one, two slow ones) serves the session's engine. Also: the
replica pool (affinity sends the id back to the replica holding it; another replica never
waits), and an id in use by a running request is still refused at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
import pytest

from pagedserve.v1 import common_pb2, generation_pb2_grpc
from services.common.errors import ServiceError
from services.engine_service import server as engine_server_module
from services.engine_service.server import EngineServer, EngineServerConfig
from services.engine_service.servicer import EngineServicer
from services.tokenizer_service.replicas.cancelled_ids import CancelledIds
from tests.services.helpers import gather, request, token_prompts, wait_for

PROMPT = token_prompts(6, seed=77)[5]
# The tiny model's first tokens hold one of these (the stream ends at once, the engine's
# request goes on until cancelled).
STOP = dict(temperature=0, max_tokens=200, stop=["a", "e", "o", "s", "t"])
LONG = dict(max_tokens=2000, ignore_eos=True)
ROUNDS = 6


class SlowToFreeServicer(EngineServicer):
    """Holds the request id of a cancelled Generate call until a later call with that id
    has been refused (module docstring). The engine's own request is aborted at once, as
    the cancellation always does: only the id stays taken."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refused: dict[str, asyncio.Event] = {}
        self.num_held = 0

    async def _generate(self, request: Any, context: Any, write: Any, batch: Any) -> None:
        request_id = request.request_id
        try:
            await super()._generate(request, context, write, batch)
        except asyncio.CancelledError:
            refused = self._refused[request_id] = asyncio.Event()
            # Taken again before anything else runs: no call can find it free meanwhile.
            with self.requests.admit(request_id, None):
                self.num_held += 1
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(refused.wait(), 60)
            raise
        except ServiceError as exc:
            if exc.code == grpc.StatusCode.ALREADY_EXISTS and request_id in self._refused:
                self._refused.pop(request_id).set()
            raise

    async def release_all(self) -> None:
        """Lets go of every id still held (no later call of it came)."""
        for refused in self._refused.values():
            refused.set()
        self._refused.clear()


def start_slow_engine_server(stack) -> EngineServer:
    async def start() -> EngineServer:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(engine_server_module, "EngineServicer", SlowToFreeServicer)
            server = EngineServer(EngineServerConfig(address="127.0.0.1:0", shutdown_grace_s=0))
        await server.start()
        await server.attach_engine(stack.engine)  # the session's engine, shared
        return server

    return stack.loop.run(start())


@pytest.fixture(scope="module")
def slow_engines(stack):
    """Two slow-to-free engine services on the session's engine (whose own engine service
    is an ordinary one)."""
    servers = start_slow_engine_server(stack), start_slow_engine_server(stack)
    yield servers
    for server in servers:
        stack.loop.run(server.stop(0))


@pytest.fixture
def tokenizer(stack):
    """Starts per-request tokenizer services: `tokenizer(engine servers, **config)` ->
    (server, public stub); stopped after the test."""
    started = []

    def start(servers, **config):
        address = ",".join(f"127.0.0.1:{s.port}" for s in servers)
        server = stack.start_tokenizer_server(
            engine_multiplex=False, engine_address=address, **config
        )
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        started.append((server, channel))
        return server, generation_pb2_grpc.TextGenerationServiceStub(channel)

    yield start
    for server, channel in started:
        channel.close()
        stack.loop.run(server.stop(0))


def num_retries(server) -> float:
    registry = server.servicer.rpc_metrics.registry
    return registry.get_sample_value("pagedserve:engine_id_retries_total")


def num_refused(engine_server: EngineServer) -> float:
    labels = {"method": "Generate", "code": "ALREADY_EXISTS"}
    value = engine_server.metrics.registry.get_sample_value("pagedserve:rpc_requests_total", labels)
    return value or 0.0


def stop_then_again(public, request_id: str, rounds: int = ROUNDS) -> None:
    """The same request_id, each time as soon as the last stream has ended."""
    for _ in range(rounds):
        req = request(token_ids=PROMPT, request_id=request_id, **STOP)
        (out,) = gather(public.Generate(req, timeout=60)).values()  # raises if refused
        assert out.finish_reason == common_pb2.FINISH_REASON_STOP
        assert out.stop_reason.text in STOP["stop"]


def wait_until_idle(stack, *engine_servers: EngineServer) -> None:
    """No request left in the engine or any engine service's registry, every block free.
    A slow engine service lets go of the ids its cancelled calls still hold (the last
    cancellation may reach it only after the client's stream has ended)."""

    def released() -> bool:
        for server in engine_servers:
            if isinstance(server.servicer, SlowToFreeServicer):
                stack.loop.run(server.servicer.release_all())
        return all(len(s.servicer.requests) == 0 for s in engine_servers)

    wait_for(released)
    stack.wait_until_idle()


def test_same_id_after_a_stop_string_over_per_request_calls(stack, tokenizer) -> None:
    """As it happens on loopback: the session's engine service, no delay."""
    _, public = tokenizer([stack.engine_server])
    stop_then_again(public, "per-request-again")
    wait_until_idle(stack, stack.engine_server)


def test_same_id_waits_for_a_cancelled_call_still_holding_it(
    stack, slow_engines, tokenizer
) -> None:
    slow, _ = slow_engines
    server, public = tokenizer([slow])
    held, refused = slow.servicer.num_held, num_refused(slow)
    stop_then_again(public, "held-again")
    # Each round after the first found the id held by the last one's cancelled call, was
    # refused, and was made again once the engine let go of the id.
    assert num_refused(slow) - refused == num_retries(server) >= ROUNDS - 1
    wait_for(lambda: slow.servicer.num_held - held == ROUNDS)  # the last one's: maybe later
    assert "held-again" in server.backend.replicas[f"127.0.0.1:{slow.port}"].cancelled_ids
    wait_until_idle(stack, slow)


def test_affinity_sends_the_same_id_back_to_the_replica_holding_it(
    stack, slow_engines, tokenizer
) -> None:
    """Two replicas, routing by prefix affinity: the same prompt goes to the same replica
    each round, and waits there for the id its last call still holds."""
    server, public = tokenizer(list(slow_engines))
    refused = [num_refused(s) for s in slow_engines]
    stop_then_again(public, "affinity-again")
    new_refusals = [num_refused(s) - r for s, r in zip(slow_engines, refused, strict=True)]
    assert sorted(new_refusals)[0] == 0  # the other replica never saw the id
    assert sum(new_refusals) == num_retries(server) >= ROUNDS - 1
    wait_until_idle(stack, *slow_engines)


def test_the_same_id_on_another_replica_meets_no_conflict(stack, slow_engines, tokenizer) -> None:
    """Round robin: the id goes to the other replica each time. The ordinary engine service
    never refuses it; the slow one still holds it from two rounds before (its own last
    call), and the new call waits for it there only."""
    slow, ordinary = slow_engines[0], stack.engine_server
    server, public = tokenizer([slow, ordinary], route_policy="round_robin")
    refused_slow, refused_ordinary = num_refused(slow), num_refused(ordinary)
    stop_then_again(public, "round-robin-again")
    assert num_refused(ordinary) == refused_ordinary
    assert num_refused(slow) - refused_slow == num_retries(server) >= ROUNDS // 2 - 1
    wait_until_idle(stack, slow, ordinary)


def test_an_id_in_use_by_a_running_request_is_refused_at_once(stack, tokenizer) -> None:
    """A request that really runs keeps its id: the same id from another tokenizer service
    is refused by the engine, with no wait and no retry, and from the same one by its own
    registry; the running request goes on undisturbed."""
    first_server, first = tokenizer([stack.engine_server])
    other_server, other = tokenizer([stack.engine_server])
    refused = num_refused(stack.engine_server)
    running = first.Generate(request(token_ids=PROMPT, request_id="live-id", **LONG), timeout=120)
    next(running)
    for public in (other, first):
        with pytest.raises(grpc.RpcError) as info:
            gather(public.Generate(request(token_ids=PROMPT, request_id="live-id", **STOP)))
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "live-id" in info.value.details()
    assert num_refused(stack.engine_server) == refused + 1  # the other's; ours: not sent
    assert num_retries(other_server) == num_retries(first_server) == 0
    assert next(running).token_ids  # still streaming
    running.cancel()
    wait_until_idle(stack, stack.engine_server)


def test_a_cancelled_id_taken_by_a_running_request_is_refused_after_the_grace(
    stack, tokenizer
) -> None:
    """The id this tokenizer service cancelled is now in use by a request that really runs
    (from another tokenizer service): the refusal is tried again only within the grace,
    then reaches the client as ALREADY_EXISTS."""
    first_server, first = tokenizer([stack.engine_server])
    _, other = tokenizer([stack.engine_server])
    (replica,) = first_server.backend.replicas.values()
    replica.cancelled_ids.grace_s = 0.5  # short: the test waits it out
    stop_then_again(first, "taken-id", rounds=1)
    assert "taken-id" in replica.cancelled_ids
    stack.wait_until_idle()
    running = other.Generate(request(token_ids=PROMPT, request_id="taken-id", **LONG), timeout=120)
    next(running)
    with pytest.raises(grpc.RpcError) as info:
        gather(first.Generate(request(token_ids=PROMPT, request_id="taken-id", **STOP)))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert num_retries(first_server) >= 1
    assert next(running).token_ids  # still streaming
    running.cancel()
    wait_until_idle(stack, stack.engine_server)


# ---- the record of cancelled ids, on a clock of our own ------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_cancelled_ids_are_kept_for_the_grace_and_taken_once() -> None:
    clock = Clock()
    ids = CancelledIds(grace_s=5.0, clock=clock)
    assert ids.take("a") is None  # never cancelled here: a refusal is final
    ids.add("a")
    clock.now += 3.0
    ids.add("b")
    assert "a" in ids and len(ids) == 2
    release = ids.take("a")
    assert release is not None and release.until == 105.0
    assert ids.take("a") is None and "a" not in ids  # taken by the new call
    clock.now += 2.5  # past b's grace? no: b was added at 103
    assert "b" in ids
    clock.now += 3.0
    assert len(ids) == 0 and ids.take("b") is None


def test_a_release_retries_only_within_the_grace() -> None:
    clock = Clock()
    ids = CancelledIds(grace_s=1.0, clock=clock)
    ids.add("a")
    release = ids.take("a")
    assert asyncio.run(release.before_retry()) is True
    clock.now += 1.0
    assert asyncio.run(release.before_retry()) is False
    assert release.num_retries == 1


def test_cancelled_ids_reject_a_negative_grace() -> None:
    with pytest.raises(ValueError, match="grace_s"):
        CancelledIds(grace_s=-1.0)
