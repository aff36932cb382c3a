"""Routing among engine replicas (services/tokenizer_service/replicas/routing.py,
services/tokenizer_service/replicas/pool.py): pure
functions over fake replicas, plus address parsing. No servers."""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from engine.api.sampling_params import SamplingParams
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from pagedserve.v1 import common_pb2
from services.tokenizer_service.replicas import routing
from services.tokenizer_service.replicas.pool import (
    EnginePool,
    format_address,
    parse_engine_addresses,
)


@dataclass
class FakeReplica:
    address: str
    num_waiting: int = 0
    num_inflight: int = 0


def test_affinity_key_is_the_kv_cache_managers_own_block_hash():
    """The key of a prompt is the hash the engine files its Nth full block under."""
    prompt = list(range(1000, 1000 + 70))  # 4 full blocks of 16, and 6 tokens
    manager = KVCacheManager(num_blocks=16, block_size=16)
    req = Request("r", prompt, SamplingParams(max_tokens=1))
    manager.get_computed_blocks(req)
    assert len(req.block_hashes) == 4
    assert routing.affinity_key(prompt, 16, prefix_blocks=4) == req.block_hashes[3]
    assert routing.affinity_key(prompt, 16, prefix_blocks=2) == req.block_hashes[1]
    assert routing.affinity_key(prompt[:15], 16, prefix_blocks=4) is None
    # Only the first blocks count: a different question after a shared prefix, same key.
    assert routing.affinity_key([*prompt[:64], 1, 2, 3], 16, 4) == req.block_hashes[3]


def test_rendezvous_moves_only_the_keys_of_a_removed_replica():
    replicas = [FakeReplica(f"10.0.0.{i}:50052") for i in range(4)]
    keys = [random.Random(i).getrandbits(256) for i in range(400)]
    owners = {k: routing.rank(k, replicas)[0].address for k in keys}
    counts = {r.address: list(owners.values()).count(r.address) for r in replicas}
    assert min(counts.values()) > 50  # spread over every replica
    gone = replicas.pop(1)
    for key in keys:
        now = routing.rank(key, replicas)[0].address
        assert now == owners[key] or owners[key] == gone.address


def test_choice_is_bounded_by_load():
    a, b = FakeReplica("a:1"), FakeReplica("b:1")
    key = next(k for k in range(1000) if routing.rank(k, [a, b])[0] is a)
    assert routing.choose(key, [a, b], max_queue_imbalance=4) is a
    a.num_waiting = 4  # four longer: still within the bound
    assert routing.choose(key, [a, b], max_queue_imbalance=4) is a
    a.num_waiting = 5  # clearly longer: the next replica in the key's order
    assert routing.choose(key, [a, b], max_queue_imbalance=4) is b
    # No key (a prompt under one block): the least loaded, by queue then calls in flight.
    a.num_waiting, b.num_inflight = 0, 3
    assert routing.choose(None, [a, b], max_queue_imbalance=4) is a


def test_engine_address_lists():
    assert parse_engine_addresses("127.0.0.1:1") == (["127.0.0.1:1"], [])
    fixed, names = parse_engine_addresses("a:1, dns:///engine:50052,[::1]:7,dns:///[::1]:8")
    assert fixed == ["a:1", "[::1]:7"] and names == [("engine", 50052), ("::1", 8)]
    for bad in ("", " , ", "dns:///engine", "dns:///:5", "dns:///e:x"):
        with pytest.raises(ValueError, match="engine address"):
            parse_engine_addresses(bad)
    assert format_address("::1", 5) == "[::1]:5" and format_address("10.0.0.1", 5) == "10.0.0.1:5"


def test_model_check_settles_on_the_first_listed_replicas_model():
    """Whichever replica answers first, the pool settles on one model: the majority of
    those reachable, a tie going to the replica listed first."""

    async def noop(available: bool, reason: str) -> None:
        pass

    right = common_pb2.ModelInfo(model="m", vocab_size=10, max_model_len=64)
    other = common_pb2.ModelInfo(model="other", vocab_size=10, max_model_len=64)
    pool = EnginePool("a:1,b:1", noop)
    a = SimpleNamespace(address="a:1", model_info=None, available=False)
    b = SimpleNamespace(address="b:1", model_info=other, available=False)
    pool.replicas = {"a:1": a, "b:1": b}
    assert pool._accepts_model(b)  # alone so far
    b.available = True
    a.model_info = right
    assert pool._accepts_model(a)  # one each: the first listed wins
    a.available = True
    assert not pool._accepts_model(b) and b.serves_another_model  # its next poll
    assert pool.model_info == right  # the agreed model (a merged copy of its limits)
