"""Physical KV-cache blocks: reference counts, an LRU free queue and the prefix-cache map.

Plain Python over integers; the tensors live in the model runner. A block's life::

                 get_new_blocks (pop head; a cached block is evicted first)
    free queue ─────────────────────────────────────────────▶ owned, ref_cnt ≥ 1
    (ref_cnt 0)                                               │  cache_full_block:
      ▲   ▲   free_blocks (ref_cnt → 0: a cached block at the │  gets a hash
      │   │   tail, an uncached one at the head)              │
      │   └───────────────────────────────────────────────────┤
      └─────── touch (a cached block with ref_cnt 0 is revived: ref_cnt 1) ◀── prefix hit

Which free block is reused first. Cached blocks go in LRU order (the one freed longest ago
is evicted first), as in vLLM. A block that holds nothing cached (a partial last block, or
any block once caching is off or the cache was reset) is reused before all of them and
before blocks never used: the CPU cache's pages are backed on first write
(worker/kv_memory.py), so reusing a block already written keeps the engine's memory to what
it has used and skips the page faults of fresh memory (~120 k of them, about 0.5 GB, in
every offline benchmark run when freed blocks queued behind the never-used ones).

Prefix caching. A full block is cached under a hash chained over the blocks before it
(engine/api/block_hash.py, shared with the tokenizer service's prefix-affinity routing)::

    hash_0 = H(None,   tokens[0:16],  extra_keys)
    hash_1 = H(hash_0, tokens[16:32], extra_keys)     ...

A hit must never return a block whose keys/values were computed for other tokens, even if
two different keys share a hash. So a cached block also keeps its own token ids, its extra
keys, and the `cache_id` of the block that preceded it when it was cached (its parent). A
lookup walks the chain one block at a time and accepts a candidate only if its tokens and
extra keys equal the query's and its parent is the block accepted one step earlier; by
induction the whole prefix matches whatever the hash does (a constant hash only makes
lookups slow). Re-checking the block's own tokens alone would not be enough: a colliding
parent hash could hand back a block computed after a different prefix.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from engine.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecorder


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block. Compared by identity (`eq=False`): ids are unique per pool."""

    block_id: int
    ref_cnt: int = 0
    # The fields below are set while the block is in the prefix cache, None otherwise.
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    extra_keys: tuple[Hashable, ...] | None = None
    cache_id: int | None = None  # unique per cached content, never reused
    parent_cache_id: int | None = None  # cache_id of the preceding block; None for block 0
    # Free-queue links; both None while the block is not in the queue.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None


class FreeBlockQueue:
    """Doubly linked list of the blocks with ref_cnt 0, in eviction order (head first).

    Every operation is O(1) per block. New blocks are taken from the head; freed cached
    blocks go to the tail, so the one freed longest ago is evicted first, and freed uncached
    ones to the head (see the module docstring); a cached block revived by a prefix hit is
    unlinked from the middle.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        # Two dummy nodes, never handed out, so that linking needs no special cases.
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self):
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        assert block is not None
        if block is self._tail:
            raise IndexError("pop from an empty FreeBlockQueue")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        assert 0 <= n <= self.num_free_blocks, f"asked for {n} of {self.num_free_blocks} blocks"
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        assert prev_block is not None and next_block is not None, (
            f"block {block.block_id} is not in the free queue"
        )
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, (
            f"block {block.block_id} is already in the free queue"
        )
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Links `block` at the head: the next one `popleft` returns."""
        assert block.prev_free is None and block.next_free is None, (
            f"block {block.block_id} is already in the free queue"
        )
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def reverse(self) -> None:
        """Reverses the queue: the block freed last comes first."""
        blocks = list(self)
        for block in blocks:
            self.remove(block)
        self.append_n(reversed(blocks))


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last read, in tokens."""

    requests: int = 0  # lookups made
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """All the KV-cache blocks: allocation, reference counts, LRU eviction, prefix-cache map.

    `enable_caching` only decides what happens to a block's hash when its ref_cnt drops to 0:
    kept (the block can be revived until it is reused) or dropped. Blocks are cached and
    looked up either way, so live requests can share.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # block_hash -> {block_id: block}. Usually one entry; more after a hash collision, or
        # when two requests computed the same block before either could hit the other's.
        self.cached_blocks: dict[int, dict[int, KVCacheBlock]] = {}
        self._cache_ids = itertools.count()
        self.prefix_cache_stats = PrefixCacheStats()
        # Prefix-cache events for routers (engine/core/kv_events.py); None: nobody listens.
        self.kv_event_recorder: KVEventRecorder | None = None

    def get_num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached or not (a cached free block is evictable)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0), 0..1."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free queue (least recently freed), ref_cnt 1."""
        assert num_blocks <= self.get_num_free_blocks(), (
            f"asked for {num_blocks} blocks, {self.get_num_free_blocks()} free"
        )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, f"block {block.block_id} in the free queue is in use"
            if block.is_cached:
                self.uncache_block(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block, reviving those with ref_cnt 0."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; one reaching 0 goes back to the free queue: at
        the tail if it is cached, at the head if not (reused first, see the module doc).

        Pass a sequence's blocks tail first, so its last blocks are evicted first. A freed
        block keeps its hash (revivable) unless caching is off.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if not self.enable_caching and block.is_cached:
                    self.uncache_block(block)
                if block.is_cached:
                    self.free_block_queue.append(block)
                else:
                    self.free_block_queue.appendleft(block)

    def get_cached_block(
        self,
        block_hash: int,
        token_ids: Sequence[int],
        parent: KVCacheBlock | None = None,
        extra_keys: tuple[Hashable, ...] | None = None,
    ) -> KVCacheBlock | None:
        """The cached block holding exactly `token_ids` after `parent`, or None.

        `parent` is the block found for the previous position (None for a sequence's first
        block); it must be cached. See the module docstring for why the parent is checked.
        """
        bucket = self.cached_blocks.get(block_hash)
        if not bucket:
            return None
        if parent is None:
            parent_cache_id = None
        else:
            assert parent.cache_id is not None, f"parent block {parent.block_id} is not cached"
            parent_cache_id = parent.cache_id
        if not isinstance(token_ids, tuple):
            token_ids = tuple(token_ids)
        for block in bucket.values():
            if (
                block.parent_cache_id == parent_cache_id
                and block.token_ids == token_ids
                and block.extra_keys == extra_keys
            ):
                return block
        return None

    def cache_full_block(
        self,
        block: KVCacheBlock,
        block_hash: int,
        token_ids: Sequence[int],
        parent: KVCacheBlock | None = None,
        extra_keys: tuple[Hashable, ...] | None = None,
    ) -> None:
        """Publish a full block that its owner has computed (or computes in this step)."""
        assert block.ref_cnt > 0, f"block {block.block_id} is free; only owned blocks are cached"
        assert not block.is_cached, f"block {block.block_id} is already cached"
        assert parent is None or parent.cache_id is not None, (
            f"parent block {parent.block_id} of block {block.block_id} is not cached"
        )
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.extra_keys = extra_keys
        block.cache_id = next(self._cache_ids)
        block.parent_cache_id = None if parent is None else parent.cache_id
        self.cached_blocks.setdefault(block_hash, {})[block.block_id] = block
        if self.kv_event_recorder is not None:
            parent_hash = None if parent is None else parent.block_hash
            self.kv_event_recorder.record(BlockStored(block_hash, parent_hash, block.token_ids))

    def uncache_block(self, block: KVCacheBlock, *, record: bool = True) -> None:
        """Remove a block from the prefix cache (its contents stay, unreachable);
        `record=False` when the caller reports the removal otherwise (a reset)."""
        assert block.block_hash is not None, f"block {block.block_id} is not cached"
        if record and self.kv_event_recorder is not None:
            self.kv_event_recorder.record(BlockRemoved(block.block_hash))
        bucket = self.cached_blocks[block.block_hash]
        del bucket[block.block_id]
        if not bucket:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        block.extra_keys = None
        block.cache_id = None
        block.parent_cache_id = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any block is in use.

        Every block is then uncached, and the free queue turns most recently freed first
        (blocks never used last), as uncached blocks are reused (see the module doc).
        """
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for bucket in list(self.cached_blocks.values()):
            for block in list(bucket.values()):
                self.uncache_block(block, record=False)
        assert not self.cached_blocks
        self.free_block_queue.reverse()
        if self.kv_event_recorder is not None:
            self.kv_event_recorder.record(AllBlocksCleared())
        return True

    def record_prefix_cache_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += num_queried_tokens
        stats.hits += num_hit_tokens

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """The counters since the last call; they restart from zero."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats
