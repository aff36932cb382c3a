"""Per-request block tables over the block pool, and the prefix-cache lookups the scheduler makes.

Token `i` of a request lives in block `block_table[i // block_size]`, slot `i % block_size`::

    block_size = 4, 10 tokens, block_table = [7, 2, 9]

    tokens  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 -- --
    block       7       |      2      |      9
    hash    h0 = H(None, t0..t3, salt)  h1 = H(h0, t4..t7, salt)   block 9: not full, no hash

A block is *published* (put in the prefix cache) when the step that computes its last token
is scheduled, not when that step has run: the model runner writes every layer's keys and
values for the whole batch before attending, so a request scheduled later in the same step
may already use it.

With a sliding window of W tokens (every layer's), the next query of a request with
`num_computed_tokens` = n sees positions >= n - W + 1 only, so its blocks wholly before that
are dropped from its table when it next allocates (their reference is released; a block
shared with a request that still needs it stays)::

    W = 6, block_size = 4, n = 13:  first needed position 8
    table  [7, 2, 9, 4]  ->  [skipped, skipped, 9, 4]   (blocks 7 and 2 freed)

A skipped entry holds block id 0: attention masks every position before the window, so
nothing reads it for real, and nothing writes there.
"""

from __future__ import annotations

from collections.abc import Hashable

from engine.api.block_hash import hash_block_tokens
from engine.config.rope import RopeRegime
from engine.core.block_pool import BlockPool, KVCacheBlock, PrefixCacheStats
from engine.core.request import Request


class KVCacheManager:
    """Owns the block pool and one block table per request. No torch."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
        rope: RopeRegime | None = None,
    ) -> None:
        """`rope`: for a model whose rope scales by the sequence's length, the regime of a
        request's rope length (engine/config/rope.py), part of every block hash of the
        request; the scheduler reads it too."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.rope = rope
        # Table entry of a block dropped out of the window (owned by no pool, never freed).
        self._skipped = KVCacheBlock(block_id=0)
        # How many leading entries of each request's table are `_skipped`.
        self.num_skipped_blocks: dict[str, int] = {}
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same tables as block ids, kept in step with req_to_blocks, so that a step's
        # block tables cost a list copy, not a walk over the blocks (issue 42).
        self._req_to_block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request's table are in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` tokens fits in the whole cache at all."""
        return self.num_blocks_needed(num_tokens) <= self.num_blocks

    def block_id_tables(self) -> dict[str, list[int]]:
        """Every request's block table as ids, live (kept in step by this manager): for
        readers that must not change them, such as the decode fast path
        (engine/core/plain_decode.py)."""
        return self._req_to_block_ids

    def get_block_ids(self, request_id: str) -> list[int]:
        ids = self._req_to_block_ids.get(request_id)
        return [] if ids is None else ids.copy()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request about to be scheduled from scratch.

        For a WAITING or PREEMPTED request (`num_computed_tokens == 0`, no blocks). Returns
        the hit blocks and the number of tokens they hold. At least one token is left to
        compute, since the model must run the last token to produce logits. Changes nothing
        but `request.block_hashes` and the stats: pass the result to `allocate_slots`
        before anything else allocates, or look up again.
        """
        assert request.num_computed_tokens == 0, f"{request} already has computed tokens"
        assert not self.req_to_blocks.get(request.request_id), f"{request} already has blocks"
        num_full_blocks = request.num_tokens // self.block_size
        self._update_block_hashes(request, num_full_blocks)
        extra_keys = self._extra_keys(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks: list[KVCacheBlock] = []
        parent: KVCacheBlock | None = None
        for i in range(max_hit_blocks):
            block = self.block_pool.get_cached_block(
                request.block_hashes[i], self._block_token_ids(request, i), parent, extra_keys
            )
            if block is None:
                break
            hit_blocks.append(block)
            parent = block
        num_hit_tokens = len(hit_blocks) * self.block_size
        if self.enable_caching:
            self.block_pool.record_prefix_cache_lookup(request.num_tokens, num_hit_tokens)
        return hit_blocks, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_computed_tokens + num_new_computed_tokens + num_new_tokens`.

        `new_computed_blocks`/`num_new_computed_tokens` are a prefix hit from
        `get_computed_blocks` (only for a request without blocks). Returns the newly
        allocated blocks (possibly none), or None, changing nothing, when too few blocks
        are free. On success, publishes every block that becomes full with tokens computed
        by the end of this step.
        """
        if not new_computed_blocks and self.sliding_window is None:
            held = self.req_to_blocks.get(request.request_id)
            num_tokens = request.num_computed_tokens + num_new_tokens
            if held and num_tokens <= len(held) * self.block_size:  # a decode step, mostly
                self.cache_full_blocks(request, min(num_tokens, request.num_tokens))
                return []
        hit_blocks = new_computed_blocks or []
        assert num_new_tokens >= 0
        assert num_new_computed_tokens == len(hit_blocks) * self.block_size, (
            "num_new_computed_tokens must be the tokens of new_computed_blocks"
        )
        blocks = self.req_to_blocks.get(request.request_id, [])
        if blocks and self.sliding_window is not None:
            self._remove_skipped_blocks(request, blocks)
        if hit_blocks:
            assert not blocks and request.num_computed_tokens == 0, (
                f"{request}: prefix hits are only for a request without blocks"
            )
            assert all(block.is_cached for block in hit_blocks), "hit block evicted since lookup"
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = self.num_blocks_needed(num_tokens) - len(blocks) - len(hit_blocks)
        num_to_allocate = max(num_required, 0)
        # Hit blocks with ref_cnt 0 sit in the free queue: touching them takes them out.
        num_revived = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        if num_to_allocate + num_revived > self.block_pool.get_num_free_blocks():
            return None

        # Touch before allocating, so that the hits are not evicted to make the new blocks.
        self.block_pool.touch(hit_blocks)
        blocks.extend(hit_blocks)
        if hit_blocks:
            self.num_cached_blocks[request.request_id] = len(hit_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_to_allocate)
        blocks.extend(new_blocks)
        self.req_to_blocks[request.request_id] = blocks
        ids = self._req_to_block_ids.setdefault(request.request_id, [])
        ids.extend(block.block_id for block in hit_blocks)
        ids.extend(block.block_id for block in new_blocks)
        self.cache_full_blocks(request, min(num_tokens, request.num_tokens))
        return new_blocks

    def free(self, request: Request) -> None:
        """Release a request's blocks, last block first. Does nothing for an unknown request.

        Reads `request.num_computed_tokens`: a published block past it (its step never ran,
        e.g. the request is preempted in the step that allocated it) leaves the cache rather
        than be revived with unwritten keys/values. Call this before resetting the count.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._req_to_block_ids.pop(request.request_id, None)
        num_cached_blocks = self.num_cached_blocks.pop(request.request_id, 0)
        num_skipped = self.num_skipped_blocks.pop(request.request_id, 0)
        if blocks is None:
            return
        num_written_blocks = request.num_computed_tokens // self.block_size
        for block in blocks[num_written_blocks:num_cached_blocks]:
            if block.ref_cnt == 1:
                self.block_pool.uncache_block(block)
        self.block_pool.free_blocks(reversed(blocks[num_skipped:]))

    def _remove_skipped_blocks(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """Releases the request's blocks wholly before the window of its next query (see
        the module doc). A block whose successor is not yet published stays: publishing
        chains each block to its predecessor."""
        assert self.sliding_window is not None
        first_needed = request.num_computed_tokens - self.sliding_window + 1
        num_droppable = max(first_needed, 0) // self.block_size
        # Full blocks are published (chained to their predecessor) with caching off too.
        num_published = self.num_cached_blocks.get(request.request_id, 0)
        num_droppable = min(num_droppable, num_published - 1)
        start = self.num_skipped_blocks.get(request.request_id, 0)
        if num_droppable <= start:
            return
        dropped = blocks[start:num_droppable]
        blocks[start:num_droppable] = [self._skipped] * len(dropped)
        self._req_to_block_ids[request.request_id][start:num_droppable] = [
            self._skipped.block_id
        ] * len(dropped)
        self.num_skipped_blocks[request.request_id] = num_droppable
        self.block_pool.free_blocks(reversed(dropped))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache queries and hits (tokens) since the last call; counted only when
        caching is enabled."""
        return self.block_pool.take_prefix_cache_stats()

    def _extra_keys(self, request: Request) -> tuple[Hashable, ...] | None:
        """The adapter (its KV differs from the base model's), the rope regime (longrope's
        long factors, dynamic NTK's theta: a prompt past the threshold changes the K/V of
        every token of the request) and the cache salt: blocks computed under two of them
        never match."""
        keys: tuple[Hashable, ...] = ()
        if request.lora_request is not None:
            keys += (("lora", request.lora_request.lora_int_id),)
        if self.rope is not None:
            regime = self.rope.key(request.rope_length)
            if regime is not None:
                keys += (("rope", regime),)
        if request.cache_salt is not None:
            keys += (request.cache_salt,)
        return keys or None

    def _block_token_ids(self, request: Request, block_index: int) -> tuple[int, ...]:
        start = block_index * self.block_size
        return tuple(request.all_token_ids[start : start + self.block_size])

    def _update_block_hashes(self, request: Request, num_full_blocks: int) -> None:
        """Extend `request.block_hashes` to its first `num_full_blocks` blocks."""
        hashes = request.block_hashes
        extra_keys = self._extra_keys(request)
        for i in range(len(hashes), num_full_blocks):
            parent_hash = hashes[-1] if hashes else None
            hashes.append(
                hash_block_tokens(parent_hash, self._block_token_ids(request, i), extra_keys)
            )

    def cache_full_blocks(self, request: Request, num_known_tokens: int) -> None:
        """Publish the request's blocks that are full within its first `num_known_tokens`
        (what `allocate_slots` does for a step that needs no new block)."""
        request_id = request.request_id
        blocks = self.req_to_blocks[request_id]
        num_full_blocks = num_known_tokens // self.block_size
        start = self.num_cached_blocks.get(request_id, 0)
        if num_full_blocks <= start:
            return
        self._update_block_hashes(request, num_full_blocks)
        extra_keys = self._extra_keys(request)
        for i in range(start, num_full_blocks):
            self.block_pool.cache_full_block(
                blocks[i],
                request.block_hashes[i],
                self._block_token_ids(request, i),
                blocks[i - 1] if i > 0 else None,
                extra_keys,
            )
        self.num_cached_blocks[request_id] = num_full_blocks
