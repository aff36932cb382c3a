"""Which engine replica a request goes to: prefix affinity, bounded by load. Pure functions.

    prompt ids ─▶ affinity key: the engine's chained hash of the prompt's first full KV
                  blocks (at most `prefix_blocks` of them): the same hash the engine's
                  prefix cache files them under, so equal keys mean a shared cached prefix
    key ─▶ replicas ranked by rendezvous hashing (highest sha256(key, address) first):
           consistent hashing, so a replica coming or going moves only its own keys
    ranked ─▶ the first one whose waiting queue is not clearly longer than the shortest
              (more than `max_queue_imbalance` requests longer); failing that, the
              least loaded

A prompt shorter than one block has no key and goes to the least loaded replica.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

from engine.api.block_hash import hash_block_tokens


class Replica(Protocol):
    address: str

    @property
    def num_waiting(self) -> int: ...

    num_inflight: int


def affinity_key(
    prompt_token_ids: Sequence[int], block_size: int, prefix_blocks: int
) -> int | None:
    """The chained block hash of the prompt's first full blocks (up to `prefix_blocks`);
    None when the prompt has no full block."""
    num_blocks = min(len(prompt_token_ids) // block_size, prefix_blocks)
    key = None
    for i in range(num_blocks):
        key = hash_block_tokens(key, prompt_token_ids[i * block_size : (i + 1) * block_size])
    return key


def _score(key: int, address: str) -> bytes:
    return hashlib.sha256(key.to_bytes(32, "little") + address.encode()).digest()


def rank(key: int, replicas: Sequence[Replica]) -> list[Replica]:
    """Rendezvous order: the replica that owns `key` first."""
    return sorted(replicas, key=lambda r: _score(key, r.address), reverse=True)


def _load(replica: Replica) -> tuple[int, int]:
    return replica.num_waiting, replica.num_inflight


def least_loaded(replicas: Sequence[Replica]) -> Replica:
    """Shortest waiting queue, then fewest calls in flight, then first listed."""
    return min(replicas, key=_load)


def choose(key: int | None, replicas: Sequence[Replica], max_queue_imbalance: int) -> Replica:
    """The replica for a request with affinity `key` (see the module docstring)."""
    assert replicas, "no replica to choose from"
    if key is None or len(replicas) == 1:
        return least_loaded(replicas)
    shortest = min(r.num_waiting for r in replicas)
    for replica in rank(key, replicas):
        if replica.num_waiting - shortest <= max_queue_imbalance:
            return replica
    raise AssertionError("the replica with the shortest queue always qualifies")
