"""One tokenizer service in front of two engine processes (127.0.0.1:P and [::1]:P):
prefix affinity, load reaching both, failover on SIGKILL, rejoin, the `dns:///` form."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import grpc
import pytest

from engine import AsyncLLMEngine, EngineArgs
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.engine_service.server import EngineServer, EngineServerConfig
from services.tokenizer_service.model_files import load_text_model_files
from services.tokenizer_service.replicas import routing
from services.tokenizer_service.replicas.pool import format_address
from services.tokenizer_service.server import TokenizerServer, TokenizerServerConfig
from tests.model_utils import make_tiny_llama
from tests.services.conftest import LoopThread
from tests.services.helpers import gather, request, wait_for
from tests.services.processes import EngineProcess, free_port

BLOCK = 16
PREFIX_BLOCKS = 4


class Cluster:
    def __init__(self, model_dir) -> None:
        self.port = free_port()  # the same port on both loopback addresses
        self.engines = [
            EngineProcess(model_dir, self.port, host=host, metrics_port=free_port(), forked=True)
            for host in ("127.0.0.1", "::1")
        ]
        for engine in self.engines:
            engine.start()
        for engine in self.engines:
            engine.wait_serving()
        self.files = load_text_model_files(str(model_dir))
        self.loop = LoopThread()
        self.servers: list[TokenizerServer] = []
        self.server = self.start_server(",".join(e.address for e in self.engines))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.public = generation_pb2_grpc.TextGenerationServiceStub(self.channel)

    def start_server(
        self, engine_address: str, poll_interval_s: float = 0.2, **kwargs
    ) -> TokenizerServer:
        async def start() -> TokenizerServer:
            config = TokenizerServerConfig(
                address="127.0.0.1:0",
                engine_address=engine_address,
                engine_poll_interval_s=poll_interval_s,
                engine_dns_refresh_s=0.2,
                route_prefix_blocks=PREFIX_BLOCKS,
            )
            server = TokenizerServer(config, self.files, **kwargs)
            await server.start()
            assert await server.backend.wait_until_available(60.0)
            return server

        server = self.loop.run(start())
        self.servers.append(server)
        return server

    def owner(self, prompt: list[int]) -> EngineProcess:
        """The engine that prefix affinity sends `prompt` to (when loads are even)."""
        key = routing.affinity_key(prompt, BLOCK, PREFIX_BLOCKS)
        fakes = [SimpleNamespace(address=e.address) for e in self.engines]
        first = routing.rank(key, fakes)[0]
        return next(e for e in self.engines if e.address == first.address)

    def prompts_owned_by(self, engine: EngineProcess, num: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        found: list[list[int]] = []
        while len(found) < num:
            prompt = [rng.randrange(3, 49152) for _ in range(PREFIX_BLOCKS * BLOCK + 4)]
            if self.owner(prompt) is engine:
                found.append(prompt)
        return found

    def close(self) -> None:
        self.channel.close()
        for server in self.servers:
            self.loop.run(server.stop(0))
        self.loop.close()
        for engine in self.engines:
            engine.stop()


@pytest.fixture(scope="module")
def cluster(tiny_model_dir) -> Iterator[Cluster]:
    cluster = Cluster(tiny_model_dir)
    yield cluster
    cluster.close()


def generate(public, prompt: list[int], max_tokens: int = 2):
    return gather(public.Generate(request(token_ids=prompt, max_tokens=max_tokens), timeout=60))


def test_shared_prefix_lands_on_one_replica_unrelated_load_on_both(cluster):
    rng = random.Random(3)
    prefix = [rng.randrange(3, 49152) for _ in range(5 * BLOCK)]  # five full blocks
    owner = cluster.owner(prefix)
    other = next(e for e in cluster.engines if e is not owner)
    before = {e.address: e.metrics() for e in cluster.engines}
    for i in range(5):
        assert generate(cluster.public, [*prefix, 100 + i, 200 + i, 300 + i])[0].token_ids
    hits = {
        e.address: e.metrics()["pagedserve:prefix_cache_hits_total"]
        - before[e.address]["pagedserve:prefix_cache_hits_total"]
        for e in cluster.engines
    }
    assert hits[owner.address] >= 4 * len(prefix)  # every request after the first hit it
    assert hits[other.address] == 0

    before = {e.address: e.metrics()["pagedserve:prompt_tokens_total"] for e in cluster.engines}
    prompts = [[rng.randrange(3, 49152) for _ in range(40)] for _ in range(16)]
    threads = [threading.Thread(target=generate, args=(cluster.public, p)) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for engine in cluster.engines:
        assert engine.metrics()["pagedserve:prompt_tokens_total"] > before[engine.address]


def test_abort_reaches_the_replica_holding_the_request_and_encode_works(cluster):
    """A stream on the second replica ([::1]) is aborted there: the engine ends it with
    finish reason ABORT (its own abort output) and counts an aborted request."""
    holder = cluster.engines[1]
    prompt = cluster.prompts_owned_by(holder, 1, seed=7)[0]

    def aborted() -> float:
        return holder.metrics().get("pagedserve:request_success_total", 0.0)

    before = aborted()
    req = request(token_ids=prompt, max_tokens=400, ignore_eos=True, request_id="abort-me")
    call = cluster.public.Generate(req, timeout=60)
    first = next(call)
    reply = cluster.public.Abort(common_pb2.AbortRequest(request_ids=["abort-me"]), timeout=10)
    assert list(reply.aborted_request_ids) == ["abort-me"]
    out = gather([first, *call])[0]
    assert out.finish_reason == common_pb2.FINISH_REASON_ABORT and len(out.token_ids) < 400
    wait_for(lambda: aborted() == before + 1)

    embeddings = cluster.public.Encode(
        generation_pb2.EncodeRequest(token_ids=[common_pb2.TokenIds(ids=[5, 6, 7])]), timeout=30
    )
    assert len(embeddings.embeddings[0].values) == 64


def test_sigkill_mid_load_fails_over_and_the_replica_rejoins(cluster):
    victim, survivor = cluster.engines
    # A second tokenizer service that polls too rarely to notice the kill by itself: its
    # first request to the dead replica fails before any token and is retried elsewhere.
    unaware = cluster.start_server(cluster.server.config.engine_address, poll_interval_s=30.0)
    # Encode goes through the same failover: to the least loaded replica, the first listed
    # (the victim) while loads are even, and elsewhere when it turns out to be dead.
    unaware_encode = cluster.start_server(
        cluster.server.config.engine_address, poll_interval_s=30.0
    )
    streams = []
    for prompt in [
        *cluster.prompts_owned_by(victim, 2, seed=1),
        *cluster.prompts_owned_by(survivor, 2, seed=2),
    ]:
        req = request(token_ids=prompt, max_tokens=300, ignore_eos=True)
        call = cluster.public.Generate(req, timeout=120)
        streams.append((cluster.owner(prompt), call, next(call)))  # running now
    victim.kill()
    with grpc.insecure_channel(f"127.0.0.1:{unaware.port}") as channel:
        public = generation_pb2_grpc.TextGenerationServiceStub(channel)
        assert unaware.backend.replicas[victim.address].available  # it does not know yet
        prompt = cluster.prompts_owned_by(victim, 1, seed=6)[0]
        assert generate(public, prompt, max_tokens=3)[0].token_ids  # retried, invisibly
        assert not unaware.backend.replicas[victim.address].available
        registry = unaware.servicer.rpc_metrics.registry
        assert registry.get_sample_value("pagedserve:engine_failovers_total") == 1
        up = {"engine_address": victim.address}
        assert registry.get_sample_value("pagedserve:engine_replica_up", up) == 0
    with grpc.insecure_channel(f"127.0.0.1:{unaware_encode.port}") as channel:
        public = generation_pb2_grpc.TextGenerationServiceStub(channel)
        assert unaware_encode.backend.replicas[victim.address].available
        reply = public.Encode(
            generation_pb2.EncodeRequest(token_ids=[common_pb2.TokenIds(ids=[5, 6, 7])] * 2),
            timeout=60,
        )
        assert [len(e.values) for e in reply.embeddings] == [64, 64]  # retried, invisibly
        assert not unaware_encode.backend.replicas[victim.address].available
        registry = unaware_encode.servicer.rpc_metrics.registry
        assert registry.get_sample_value("pagedserve:engine_failovers_total") == 1
    # Requests not yet started: no client error, even those whose affinity is the victim.
    for prompt in cluster.prompts_owned_by(victim, 3, seed=4):
        out = generate(cluster.public, prompt, max_tokens=3)[0]
        assert out.finish_reason == common_pb2.FINISH_REASON_LENGTH
    for _owner, call, first in streams:  # those on the dead replica moved to the survivor
        out = gather([first, *call])[0]
        assert out.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert len(out.token_ids) == out.usage.completion_tokens == 300

    health = cluster.public.Health(common_pb2.HealthRequest(), timeout=10)
    assert health.healthy  # one replica is enough
    assert health.details[f"replica.{victim.address}"].startswith("down")

    victim.start()
    victim.wait_serving()
    # Back in routing by the poll alone (no request needed to find it); how fast depends on
    # the machine's load, so only that it comes back is asserted.
    wait_for(
        lambda: (
            cluster.public.Health(common_pb2.HealthRequest(), timeout=10)
            .details[f"replica.{victim.address}"]
            .startswith("up")
        )
    )
    prompt = cluster.prompts_owned_by(victim, 1, seed=5)[0]
    generate(cluster.public, prompt)
    assert victim.metrics()["pagedserve:prompt_tokens_total"] >= len(prompt)  # a fresh process


def test_dns_names_resolve_to_every_replica_and_follow_changes(cluster):
    port = cluster.port
    # The system resolver: localhost is 127.0.0.1 here.
    server = cluster.start_server(f"dns:///localhost:{port}")
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        public = generation_pb2_grpc.TextGenerationServiceStub(channel)
        assert generate(public, [5, 6, 7])[0].token_ids
        details = public.Health(common_pb2.HealthRequest(), timeout=10).details
        assert [k for k in details if k.startswith("replica.")] == [f"replica.127.0.0.1:{port}"]

    # A name with several addresses (what a headless Service answers); the seam replaces
    # only the system lookup, so a changed answer can be served between refreshes.
    answer = ["127.0.0.1", "::1"]

    async def resolver(host: str, resolved_port: int) -> list[str]:
        assert host == "engines.test"
        return [format_address(ip, resolved_port) for ip in answer]

    server = cluster.start_server(f"dns:///engines.test:{port}", resolver=resolver)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        public = generation_pb2_grpc.TextGenerationServiceStub(channel)

        def replicas() -> dict[str, str]:
            details = public.Health(common_pb2.HealthRequest(), timeout=10).details
            return {k: v for k, v in details.items() if k.startswith("replica.")}

        wait_for(
            lambda: len(replicas()) == 2 and all(v.startswith("up") for v in replicas().values())
        )
        for seed in range(2):
            for prompt in cluster.prompts_owned_by(cluster.engines[1], 1, seed=10 + seed):
                assert generate(public, prompt)[0].token_ids
        answer.remove("::1")
        wait_for(lambda: list(replicas()) == [f"replica.127.0.0.1:{port}"])
        assert generate(public, [8, 9, 10])[0].token_ids


def test_a_replica_serving_another_model_is_excluded(cluster, tmp_path, caplog):
    other_dir = make_tiny_llama(tmp_path / "other", hidden_size=32, with_tokenizer=True)
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=str(other_dir), skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)
    )

    async def serve() -> EngineServer:
        server = EngineServer(EngineServerConfig(address="127.0.0.1:0"))
        await server.start()
        await server.attach_engine(engine)
        return server

    other = cluster.loop.run(serve())
    try:
        with caplog.at_level(logging.WARNING, logger="services.tokenizer_service.replicas.pool"):
            addresses = f"{cluster.engines[0].address},127.0.0.1:{other.port}"
            server = cluster.start_server(addresses)
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                public = generation_pb2_grpc.TextGenerationServiceStub(channel)

                def excluded() -> bool:
                    details = public.Health(common_pb2.HealthRequest(), timeout=10).details
                    return details[f"replica.127.0.0.1:{other.port}"].startswith("down")

                # Within a poll of both answering, whichever answered first (a tie goes to
                # the replica listed first).
                wait_for(excluded)
                for i in range(4):  # every request goes to the right model
                    assert generate(public, [5 + i, 6, 7])[0].token_ids
                details = public.Health(common_pb2.HealthRequest(), timeout=10).details
        assert details[f"replica.127.0.0.1:{other.port}"].startswith("down")
        assert details[f"replica.{cluster.engines[0].address}"].startswith("up")
        assert any("another model" in r.getMessage() for r in caplog.records)
    finally:
        cluster.loop.run(other.stop(0))
        engine.shutdown()
