"""Block pool: free queue, reference counts, LRU eviction, the prefix-cache map. No torch."""

import pytest

from engine.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from engine.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecorder


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


# --- FreeBlockQueue ------------------------------------------------------------------


def test_free_queue_fifo_and_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 5 and ids(queue) == [0, 1, 2, 3, 4]

    queue.remove(blocks[2])  # middle
    queue.remove(blocks[0])  # head
    queue.remove(blocks[4])  # tail
    assert ids(queue) == [1, 3] and len(queue) == 2
    assert blocks[2] not in queue and blocks[3] in queue

    queue.append(blocks[2])
    queue.append_n([blocks[4], blocks[0]])
    assert ids(queue) == [1, 3, 2, 4, 0]
    assert queue.popleft() is blocks[1]
    assert ids(queue.popleft_n(2)) == [3, 2]
    assert ids(queue) == [4, 0] and len(queue) == 2
    # Backward links agree with forward ones.
    assert blocks[0].prev_free is blocks[4] and blocks[4].prev_free is not None


def test_free_queue_misuse_asserts():
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeBlockQueue(blocks)
    with pytest.raises(AssertionError):
        queue.append(blocks[0])  # already queued
    queue.remove(blocks[0])
    with pytest.raises(AssertionError):
        queue.remove(blocks[0])  # not queued
    with pytest.raises(AssertionError):
        queue.popleft_n(2)
    queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
    assert len(queue) == 0 and list(queue) == []


# --- BlockPool -----------------------------------------------------------------------


def test_allocate_and_free_reference_counts():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.get_num_free_blocks() == 1 and pool.get_usage() == 0.75
    with pytest.raises(AssertionError):
        pool.get_new_blocks(2)

    pool.touch(blocks[:1])
    pool.free_blocks(blocks[:1])
    assert blocks[0].ref_cnt == 1 and pool.get_num_free_blocks() == 1
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == 4 and pool.get_usage() == 0.0
    # Uncached blocks go to the head as they are freed (2, then 1, then 0): reused before
    # block 3, never used.
    assert ids(pool.free_block_queue) == [0, 1, 2, 3]


def test_cached_blocks_queue_lru_and_a_reset_turns_the_queue_newest_first():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    for i, block in enumerate(blocks):
        pool.cache_full_block(
            block, block_hash=i, token_ids=(i,), parent=blocks[i - 1] if i else None
        )
    pool.free_blocks(reversed(blocks))
    # Cached: behind the never-used blocks, the last block first (evicted first among them).
    assert ids(pool.free_block_queue) == [3, 4, 2, 1, 0]
    assert pool.reset_prefix_cache()
    assert not any(block.is_cached for block in pool.blocks)
    # Nothing is cached any more: the blocks freed last (their pages written) come first.
    assert ids(pool.free_block_queue) == [0, 1, 2, 4, 3]
    assert ids(pool.get_new_blocks(2)) == [0, 1]


def test_double_free_asserts():
    pool = BlockPool(2)
    [block] = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="freed more often"):
        pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.get_num_free_blocks() == 2


def test_cached_block_lookup_checks_tokens_parent_and_extra_keys():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 7, (1, 2), None, ("s",))
    pool.cache_full_block(b, 7, (3, 4), a, ("s",))  # same hash: a collision
    assert pool.get_cached_block(7, (1, 2), None, ("s",)) is a
    assert pool.get_cached_block(7, [1, 2], None, ("s",)) is a  # a list works too
    assert pool.get_cached_block(7, (3, 4), a, ("s",)) is b
    assert pool.get_cached_block(7, (3, 4), None, ("s",)) is None  # wrong parent
    assert pool.get_cached_block(7, (1, 2), a, ("s",)) is None  # right tokens, wrong place
    assert pool.get_cached_block(7, (1, 2), None, ("t",)) is None  # other salt
    assert pool.get_cached_block(7, (1, 2), None, None) is None
    assert pool.get_cached_block(8, (1, 2), None, ("s",)) is None  # other hash
    with pytest.raises(AssertionError):
        pool.cache_full_block(a, 9, (1, 2))  # already cached
    [c] = pool.get_new_blocks(1)
    with pytest.raises(AssertionError):
        pool.get_cached_block(7, (3, 4), c)  # parent not cached


def test_lru_eviction_and_revival():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for i, block in enumerate(blocks):
        pool.cache_full_block(block, 100 + i, (i,))
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert ids(pool.free_block_queue) == [2, 0, 3, 1]
    assert all(block.is_cached for block in blocks)  # freed blocks stay cached

    # A hit revives block 3 from the middle of the queue.
    hit = pool.get_cached_block(103, (3,))
    assert hit is blocks[3]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and ids(pool.free_block_queue) == [2, 0, 1]
    assert pool.get_num_free_blocks() == 3

    # New blocks come from the head (least recently freed) and lose their hash.
    new = pool.get_new_blocks(2)
    assert ids(new) == [2, 0]
    assert not blocks[2].is_cached and not blocks[0].is_cached
    assert pool.get_cached_block(102, (2,)) is None and pool.get_cached_block(100, (0,)) is None
    assert pool.get_cached_block(101, (1,)) is blocks[1]  # not yet evicted
    assert set(pool.cached_blocks) == {101, 103}


def test_caching_disabled_drops_hash_on_last_free():
    pool = BlockPool(2, enable_caching=False)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_block(block, 5, (1,))
    pool.touch([pool.get_cached_block(5, (1,))])  # a live sharer still hits
    pool.free_blocks([block])
    assert pool.get_cached_block(5, (1,)) is block
    pool.free_blocks([block])
    assert not block.is_cached and pool.cached_blocks == {}
    assert pool.get_cached_block(5, (1,)) is None


def test_reset_prefix_cache_only_when_all_free():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_block(blocks[0], 1, (1,))
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(1, (1,)) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {} and not blocks[0].is_cached
    assert pool.get_num_free_blocks() == 3


def test_prefix_cache_stats_reset_on_read():
    pool = BlockPool(1)
    pool.record_prefix_cache_lookup(32, 16)
    pool.record_prefix_cache_lookup(8, 0)
    stats = pool.take_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 40, 16)
    assert stats.hit_rate == pytest.approx(0.4)
    assert pool.take_prefix_cache_stats().queries == 0


def test_kv_events_follow_caching_eviction_and_reset():
    """Stored / removed / cleared events, with the pool's own hashes, only while recording."""
    pool = BlockPool(num_blocks=3)
    recorder = KVEventRecorder()
    pool.kv_event_recorder = recorder
    (b0,) = pool.get_new_blocks(1)
    pool.cache_full_block(b0, 11, (1, 2))
    assert recorder.take() == ()  # not active: nothing buffered
    recorder.set_active(True)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_block(b1, 22, (3, 4), parent=b0)
    assert list(recorder.take()) == [BlockStored(22, 11, (3, 4))]
    pool.free_blocks([b2, b1, b0])  # b2 (uncached) first in the queue, then b1
    pool.get_new_blocks(2)  # evicts b1
    assert list(recorder.take()) == [BlockRemoved(22)]
    pool.free_blocks([b2, b1])
    assert pool.reset_prefix_cache()
    assert list(recorder.take()) == [AllBlocksCleared()]
    recorder.set_active(False)
    assert recorder.take() == ()
