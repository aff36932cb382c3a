"""Prefix-cache events: which blocks the block pool cached, evicted or cleared.

A cache-aware router (smg's `cache_aware` policy, llm-d's KV-cache indexer) keeps a map of
which prefix blocks each engine holds, from a stream of these events. The block hashes are
the KV-cache manager's own chained hashes (`engine/api/block_hash.py`), so a router that
hashes a prompt the same way finds exactly the blocks an engine would hit.

    BlockPool.cache_full_block ──▶ BlockStored(hash, parent hash, token ids)
    BlockPool.uncache_block    ──▶ BlockRemoved(hash)      (eviction, or caching off)
    BlockPool.reset_prefix_cache ─▶ AllBlocksCleared()

Plain Python, no torch. Recording costs nothing while nobody listens: the pool holds no
`KVEventRecorder` until one is attached, and the recorder buffers only while it has
subscribers. The engine thread drains the buffer once per step (`take`), so events reach
subscribers in step order, one batch per step.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

_INT64_MASK = (1 << 64) - 1


def block_hash_to_int64(block_hash: int) -> int:
    """The low 64 bits of a (256-bit) block hash as a signed int64: the width of the
    `block_hash` fields of the ecosystem's KV-event protocol. Routers compare hashes for
    equality only, so the truncation costs nothing but a 2^-64 collision chance."""
    low = block_hash & _INT64_MASK
    return low - (1 << 64) if low >= 1 << 63 else low


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hash: int
    parent_block_hash: int | None  # None for a sequence's first block
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hash: int


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventRecorder:
    """Collects the block pool's events while at least one subscriber wants them.

    `record` runs on the engine thread inside the pool's operations; `take` on the engine
    thread after each step; `set_active` from any thread (a subscriber coming or going).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[KVCacheEvent] = []
        self.active = False  # read without the lock on the hot path: a stale read only
        # records or drops the events of one step around a (un)subscription

    def set_active(self, active: bool) -> None:
        with self._lock:
            self.active = active
            if not active:
                self._events.clear()

    def record(self, event: KVCacheEvent) -> None:
        if self.active:
            with self._lock:
                self._events.append(event)

    def take(self) -> Sequence[KVCacheEvent]:
        """The events since the last call (empty when there were none)."""
        if not self._events:
            return ()
        with self._lock:
            events, self._events = self._events, []
        return events
