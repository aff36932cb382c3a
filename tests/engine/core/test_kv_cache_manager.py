"""KV-cache manager: block tables, prefix hits, atomic allocation, eviction. No torch."""

import random
from collections import Counter

import pytest

from engine.api.sampling_params import SamplingParams
from engine.core import kv_cache_manager
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request

BS = 4  # small blocks keep the token lists short
VOCAB = 3  # token ids in the randomized test


def make_request(request_id: str, token_ids, cache_salt: str | None = None) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(), cache_salt=cache_salt)


def schedule(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None):
    """What the scheduler does for a waiting request: look up, allocate, count as computed."""
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit_tokens
    new_blocks = manager.allocate_slots(request, num_new_tokens, hit_blocks, num_hit_tokens)
    if new_blocks is not None:
        request.num_computed_tokens = num_hit_tokens + num_new_tokens
    return hit_blocks, num_hit_tokens, new_blocks


def snapshot(manager: KVCacheManager):
    pool = manager.block_pool
    return (
        [(block.ref_cnt, block.block_hash, block.cache_id) for block in pool.blocks],
        [block.block_id for block in pool.free_block_queue],
        {rid: [b.block_id for b in table] for rid, table in manager.req_to_blocks.items()},
        dict(manager.num_cached_blocks),
    )


def test_block_table_grows_by_blocks():
    manager = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=True)
    assert [manager.num_blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert manager.can_fit(32) and not manager.can_fit(33)
    request = make_request("a", range(10))
    _, _, new_blocks = schedule(manager, request)
    assert len(new_blocks) == 3 and manager.get_block_ids("a") == [b.block_id for b in new_blocks]
    assert manager.get_num_free_blocks() == 5 and manager.usage == pytest.approx(3 / 8)

    # Decode: tokens 10 and 11 fit in the third block, token 12 needs a fourth.
    for expected_new in (0, 0, 1):
        request.append_output_token_ids([99])
        new_blocks = manager.allocate_slots(request, 1)
        assert len(new_blocks) == expected_new
        request.num_computed_tokens += 1
    assert len(manager.get_block_ids("a")) == 4
    assert manager.get_block_ids("unknown") == []


def test_shared_prefix_hits_same_blocks():
    manager = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    a = make_request("a", [*range(8), 50, 51])  # two full blocks + 2 tokens
    schedule(manager, a)
    b = make_request("b", [*range(8), 60, 61, 62])
    hit_blocks, num_hit_tokens, new_blocks = schedule(manager, b)
    assert num_hit_tokens == 8
    assert [blk.block_id for blk in hit_blocks] == manager.get_block_ids("a")[:2]
    assert manager.get_block_ids("b")[:2] == manager.get_block_ids("a")[:2]
    assert len(new_blocks) == 1 and new_blocks[0].block_id not in manager.get_block_ids("a")
    assert [blk.ref_cnt for blk in hit_blocks] == [2, 2]
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 21, 8)
    assert manager.make_prefix_cache_stats().requests == 0


def test_hit_leaves_at_least_one_token_to_compute():
    manager = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    schedule(manager, make_request("a", range(8)))
    _, num_hit_tokens, _ = schedule(manager, make_request("b", range(8)))
    assert num_hit_tokens == 4  # all 8 cached, last block dropped
    _, num_hit_tokens, _ = schedule(manager, make_request("c", range(9)))
    assert num_hit_tokens == 8
    _, num_hit_tokens, _ = schedule(manager, make_request("d", range(4)))
    assert num_hit_tokens == 0


def test_allocation_failure_changes_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True)
    a = make_request("a", range(12))
    schedule(manager, a)
    manager.free(a)  # 3 cached blocks now sit in the free queue
    before = snapshot(manager)

    # 3 hits (all from the free queue) + 2 new blocks: 5 > 4 free, although 2 new <= 4.
    b = make_request("b", range(20))
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 12
    assert manager.allocate_slots(b, 8, hit_blocks, num_hit_tokens) is None
    assert snapshot(manager) == before
    assert manager.allocate_slots(b, 4, hit_blocks, num_hit_tokens) is not None  # 3 + 1 fits

    # A running request that cannot grow is left as it was.
    c = make_request("c", range(100, 105))
    before = snapshot(manager)
    assert manager.allocate_slots(c, 5) is None
    assert snapshot(manager) == before and "c" not in manager.req_to_blocks


def test_hash_collision_never_returns_wrong_block(monkeypatch):
    monkeypatch.setattr(kv_cache_manager, "hash_block_tokens", lambda *args: 0)
    manager = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    # d's second block holds the same tokens as a's, after a different first block; d is
    # cached first so its blocks come first in the (single) hash bucket.
    d = make_request("d", [10, 11, 12, 13, 5, 6, 7, 8, 9])
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    schedule(manager, d)
    schedule(manager, a)
    assert len(manager.block_pool.cached_blocks[0]) == 4

    hit_blocks, _, _ = schedule(manager, make_request("e", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    assert [b.block_id for b in hit_blocks] == manager.get_block_ids("a")[:2]
    # a's second block's tokens at position 0: no hit.
    _, num_hit_tokens, _ = schedule(manager, make_request("f", [5, 6, 7, 8, 5, 6, 7, 8, 0]))
    assert num_hit_tokens == 0
    # Right first block, different second block.
    _, num_hit_tokens, _ = schedule(manager, make_request("g", [1, 2, 3, 4, 5, 6, 7, 0, 0]))
    assert num_hit_tokens == 4


def test_lru_eviction_and_revival():
    manager = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=True)
    a = make_request("a", range(9))  # 2 full blocks + 1
    b = make_request("b", range(100, 109))
    schedule(manager, a)
    schedule(manager, b)
    a_ids, b_ids = manager.get_block_ids("a"), manager.get_block_ids("b")
    manager.free(a)
    manager.free(b)
    # Freed tail first, a before b. The partial last blocks hold nothing cached and go to
    # the head (reused first, newest first); the full ones queue in LRU order.
    queue = manager.block_pool.free_block_queue
    assert [blk.block_id for blk in queue] == [b_ids[2], a_ids[2], *a_ids[1::-1], *b_ids[1::-1]]

    # b's prompt revives b's two full blocks from the middle of the queue.
    b2 = make_request("b2", range(100, 109))
    hit_blocks, num_hit_tokens, new_blocks = schedule(manager, b2)
    assert [blk.block_id for blk in hit_blocks] == b_ids[:2] and num_hit_tokens == 8
    assert all(blk.ref_cnt == 1 and blk not in queue for blk in hit_blocks)
    # The new block is an uncached one from the head: b's partial last block.
    assert [blk.block_id for blk in new_blocks] == [b_ids[2]]

    # Three more blocks take a's partial block, then evict a's second block, then its first.
    c = make_request("c", range(200, 212))
    _, _, new_blocks = schedule(manager, c)
    assert [blk.block_id for blk in new_blocks] == [a_ids[2], a_ids[1], a_ids[0]]
    _, num_hit_tokens, _ = schedule(manager, make_request("a2", range(9)))
    assert num_hit_tokens == 0
    assert manager.get_num_free_blocks() == 0


def test_salts_isolate():
    manager = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    schedule(manager, make_request("a", range(9), cache_salt="x"))
    assert schedule(manager, make_request("b", range(9), cache_salt="y"))[1] == 0
    assert schedule(manager, make_request("c", range(9)))[1] == 0
    assert schedule(manager, make_request("d", range(9), cache_salt="x"))[1] == 8
    assert schedule(manager, make_request("e", range(9)))[1] == 8  # shares with c


def test_caching_disabled_shares_only_between_live_requests():
    manager = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=False)
    a = make_request("a", range(9), cache_salt="family-1")
    b = make_request("b", range(9), cache_salt="family-1")
    schedule(manager, a)
    hit_blocks, num_hit_tokens, _ = schedule(manager, b)  # live sibling: shared
    assert num_hit_tokens == 8
    assert [blk.block_id for blk in hit_blocks] == manager.get_block_ids("a")[:2]
    manager.free(a)
    assert schedule(manager, make_request("c", range(9), cache_salt="family-1"))[1] == 8
    manager.free(b)
    manager.free(make_request("c", []))
    assert manager.get_num_free_blocks() == 16
    assert manager.block_pool.cached_blocks == {}  # hashes dropped with the last reference
    assert schedule(manager, make_request("d", range(9), cache_salt="family-1"))[1] == 0
    assert manager.make_prefix_cache_stats().requests == 0  # stats only with caching on


def test_blocks_published_at_allocation_hit_in_same_step():
    manager = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    a = make_request("a", range(14))
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(a)
    manager.allocate_slots(a, 6, hit_blocks, num_hit_tokens)  # chunk: tokens 0..5
    # Same step, a not yet run: b hits the block a computes in this step, not block 1.
    b = make_request("b", range(14))
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 4 and hit_blocks[0].block_id == manager.get_block_ids("a")[0]
    manager.allocate_slots(b, 10, hit_blocks, num_hit_tokens)
    a.num_computed_tokens, b.num_computed_tokens = 6, 14  # end of step

    # a's next chunk: its blocks 1-2 are b's already but a computes them in its own blocks.
    manager.allocate_slots(a, 8)
    a.num_computed_tokens = 14
    assert manager.num_cached_blocks == {"a": 3, "b": 3}
    assert len(manager.block_pool.cached_blocks) == 3  # 3 hashes, 5 blocks
    assert sum(len(bucket) for bucket in manager.block_pool.cached_blocks.values()) == 5


def test_free_drops_published_blocks_never_computed():
    manager = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    a = make_request("a", range(9))
    schedule(manager, a, num_new_tokens=4)  # step 1 computes block 0
    manager.allocate_slots(a, 5)  # step 2 publishes block 1 ...
    manager.free(a)  # ... but a is preempted before it runs
    a.num_computed_tokens = 0
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(make_request("b", range(9)))
    assert num_hit_tokens == 4 and hit_blocks[0].block_id == 0


def test_preempted_request_resumes_from_its_own_blocks():
    manager = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    a = make_request("a", range(6))
    schedule(manager, a)
    for token in (40, 41, 42):  # decode: 9 tokens, the last one not yet computed
        a.append_output_token_ids([token])
        manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    a.append_output_token_ids([43])
    table = manager.get_block_ids("a")
    manager.free(a)  # preempt: free first, then forget the computed tokens
    manager.free(a)  # idempotent
    a.num_computed_tokens = 0
    assert manager.get_num_free_blocks() == 16
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(a)
    assert num_hit_tokens == 8 and [blk.block_id for blk in hit_blocks] == table[:2]
    assert len(a.block_hashes) == 2


def test_reset_prefix_cache():
    manager = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=True)
    a = make_request("a", range(9))
    schedule(manager, a)
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert schedule(manager, make_request("b", range(9)))[1] == 0


# --- randomized property test ---------------------------------------------------------


def check_invariants(manager: KVCacheManager, live_ids: set[str]) -> None:
    pool = manager.block_pool
    assert set(manager.req_to_blocks) <= live_ids
    refs: Counter[int] = Counter()
    for request_id, table in manager.req_to_blocks.items():
        assert len({blk.block_id for blk in table}) == len(table)  # no block twice in a table
        refs.update(blk.block_id for blk in table)
        num_cached = manager.num_cached_blocks.get(request_id, 0)
        assert all(blk.is_cached for blk in table[:num_cached])
        assert not any(blk.is_cached for blk in table[num_cached:])
    free_ids = [blk.block_id for blk in pool.free_block_queue]
    assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
    # Every block is in exactly one place: the free queue (ref_cnt 0) or some tables.
    assert [blk.ref_cnt for blk in pool.blocks] == [refs[i] for i in range(pool.num_blocks)]
    assert set(free_ids) == {i for i in range(pool.num_blocks) if not refs[i]}
    assert len(free_ids) + len(refs) == pool.num_blocks
    cached = [blk for blk in pool.blocks if blk.is_cached]
    assert len(cached) == sum(len(bucket) for bucket in pool.cached_blocks.values())
    for block in cached:
        assert pool.cached_blocks[block.block_hash][block.block_id] is block
        assert manager.enable_caching or block.ref_cnt > 0


@pytest.mark.parametrize(
    ("seed", "enable_caching", "constant_hash"),
    [(0, True, False), (1, False, False), (2, True, True)],
)
def test_random_operations_keep_invariants(monkeypatch, seed, enable_caching, constant_hash):
    if constant_hash:
        monkeypatch.setattr(kv_cache_manager, "hash_block_tokens", lambda *args: 0)
    rng = random.Random(seed)
    manager = KVCacheManager(num_blocks=40, block_size=BS, enable_caching=enable_caching)
    # Few distinct tokens: equal blocks at different positions or after different prefixes
    # are common, so a lookup that checked only the tokens would return wrong blocks.
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    # What each slot holds: the keys/values of the last token of this token prefix.
    kv: dict[tuple[int, int], tuple[int, ...]] = {}
    waiting: list[Request] = []
    running: list[Request] = []

    def execute(request: Request, num_tokens: int) -> None:
        table = manager.req_to_blocks[request.request_id]
        start = request.num_computed_tokens
        for pos in range(start, start + num_tokens):
            kv[table[pos // BS].block_id, pos % BS] = tuple(request.all_token_ids[: pos + 1])
        request.num_computed_tokens += num_tokens
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids([rng.randrange(VOCAB)])  # sample

    def preempt(request: Request) -> None:
        manager.free(request)
        request.num_computed_tokens = 0
        running.remove(request)
        waiting.append(request)

    for step in range(1500):
        op = rng.random()
        if (op < 0.15 and len(waiting) < 6) or not (waiting or running):
            tail = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 10))]
            salt = rng.choice([None, None, "s"])
            waiting.append(make_request(f"r{step}", rng.choice(prefixes) + tail, salt))
        elif op < 0.4 and waiting:
            request = waiting.pop(rng.randrange(len(waiting)))
            hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
            assert num_hit_tokens < request.num_tokens
            for i, block in enumerate(hit_blocks):  # a hit holds exactly this prefix
                for slot in range(BS):
                    pos = i * BS + slot
                    assert kv[block.block_id, slot] == tuple(request.all_token_ids[: pos + 1])
            num_new_tokens = rng.randint(1, request.num_tokens - num_hit_tokens)
            before = snapshot(manager)
            new_blocks = manager.allocate_slots(request, num_new_tokens, hit_blocks, num_hit_tokens)
            if new_blocks is None:
                assert snapshot(manager) == before
                waiting.append(request)
            elif rng.random() < 0.1:  # preempted in the step that allocated it
                manager.free(request)
                waiting.append(request)
            else:
                request.num_computed_tokens = num_hit_tokens
                execute(request, num_new_tokens)
                running.append(request)
        elif op < 0.85 and running:
            request = rng.choice(running)
            num_new_tokens = rng.randint(1, request.num_tokens - request.num_computed_tokens)
            if manager.allocate_slots(request, num_new_tokens) is None:
                preempt(request)
            else:
                execute(request, num_new_tokens)
                if request.num_tokens > 40:
                    running.remove(request)
                    manager.free(request)
        elif op < 0.95 and running:
            request = rng.choice(running)
            running.remove(request)
            manager.free(request)  # finished or aborted
        elif running:
            preempt(rng.choice(running))
        check_invariants(manager, {r.request_id for r in waiting + running})

    for request in running:
        manager.free(request)
    check_invariants(manager, set())
    assert manager.get_num_free_blocks() == manager.num_blocks
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    stats = manager.make_prefix_cache_stats()
    assert (stats.hits > 0) == enable_caching
    assert manager.reset_prefix_cache() is True
