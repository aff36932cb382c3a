"""The prefix cache's chained block hash, torch-free and stable across processes.

The engine's KV-cache manager files full blocks under it (engine/core/block_pool.py) and the
tokenizer service routes a prompt to the replica likely to hold its prefix by hashing the same
way (services/tokenizer_service/replicas/routing.py); KV events carry these hashes to gateways.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Hashable, Sequence


def hash_block_tokens(
    parent_hash: int | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Hashable, ...] | None = None,
) -> int:
    """Chained hash of one full block: SHA-256 over (parent hash, token ids, extra keys).

    Why SHA-256 rather than Python's `hash` of a tuple: `hash` of ints is 64-bit and unkeyed,
    so prompts can be crafted to collide. Lookups re-check tokens and parents, so a collision
    never returns a wrong block, but it lengthens a hash bucket that every lookup scans.
    SHA-256 is also stable across processes (str hashing is randomized per process), which
    cache-aware routing or KV events would need. Cost: a few microseconds per block.

    The encoding is unambiguous: a presence byte for the parent, a length before the tokens,
    and the extra keys (repr of a tuple of str/int) last.
    """
    hasher = hashlib.sha256()
    if parent_hash is None:
        hasher.update(b"\x00")
    else:
        hasher.update(b"\x01" + parent_hash.to_bytes(32, "little"))
    hasher.update(len(token_ids).to_bytes(4, "little"))
    hasher.update(array("q", token_ids).tobytes())
    if extra_keys:
        hasher.update(repr(extra_keys).encode())
    return int.from_bytes(hasher.digest(), "little")
