"""The decode fast path (engine/core/plain_decode.py) against the general path.

Two schedulers run the same workload: one as built (plain rows scheduled and updated by
the fast path), one with the fast path off (`_plain = None`) and every row updated by the
general `_update_entry`. Every step must agree: the entries, block tables, preemptions,
statuses, stop reasons, prefix-cache contents and fairness counters (exactly: the same
float operations in the same order). No torch, no model.
"""

from __future__ import annotations

import random
import time

import pytest

from engine.api.sampling_params import SamplingParams
from engine.config.resolved import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.plain_decode import PlainDecode
from engine.core.request import Request, RequestStatus
from engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from engine.core.scheduler import Scheduler

EOS = 2
STOP_ID = 3


def _scheduler(fairness: str, num_blocks: int, max_model_len: int) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=12,
        max_num_batched_tokens=40,
        max_model_len=max_model_len,
        fairness=fairness,  # type: ignore[arg-type]
        fairness_output_token_weight=2.5,
    )
    return Scheduler(config, KVCacheManager(num_blocks, 4, enable_caching=True))


def _general_update(
    scheduler: Scheduler, output: SchedulerOutput, runner_output: ModelRunnerOutput
) -> list[Request]:
    """`Scheduler.update` with every live row through the general path."""
    now = time.time()
    updated: list[Request] = []
    scheduler.num_output_tokens_last_update = 0
    for entry in output.scheduled:
        request = entry.request
        if request.is_finished() or request.num_preemptions != entry.num_preemptions:
            continue
        scheduler._update_entry(entry, runner_output, now, updated)
    return updated


def _requests(seed: int) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(20):
        params = SamplingParams(
            max_tokens=rng.choice([None, 2, 5, 9, 30]),
            stop_token_ids=[STOP_ID] if rng.random() < 0.7 else None,
            min_tokens=rng.choice([0, 0, 2]),
            ignore_eos=rng.random() < 0.3,
        )
        params.update_from_generation_config({EOS})
        # Prompts share prefixes, so published blocks get hit.
        prompt = [10 + (i % 3)] * 4 + [20 + j for j in range(rng.randint(1, 10))]
        request = Request(f"r{i}", prompt, params, arrival_time=float(i))
        request.fairness_key = f"k{i % 3}"
        request.fairness_weight = 1.0 + (i % 3) / 3
        requests.append(request)
    return requests


def _sampled(output: SchedulerOutput, step: int, rng: random.Random) -> ModelRunnerOutput:
    runner = ModelRunnerOutput()
    for entry in output.scheduled:
        if entry.samples:
            draw = rng.random()
            token = EOS if draw < 0.04 else STOP_ID if draw < 0.12 else 30 + (step % 7)
            runner.sampled_token_ids[entry.request_id] = token
    return runner


def _state(scheduler: Scheduler) -> tuple:
    kv = scheduler.kv_cache_manager
    counters = {
        key: (state.counter, state.reserved, state.num_unfinished)
        for key, state in scheduler.fairness.keys.items()
    }
    return (
        kv.get_num_free_blocks(),
        dict(kv.num_cached_blocks),
        sorted(
            (block_hash, sorted(b.block_id for b in blocks.values()))
            for block_hash, blocks in kv.block_pool.cached_blocks.items()
        ),
        counters,
        scheduler.num_output_tokens_last_update,
        [r.request_id for r in scheduler.running],
    )


def _entries(output: SchedulerOutput) -> list[tuple]:
    return [
        (e.request_id, e.num_computed_tokens, e.num_new_tokens, e.block_ids, e.num_preemptions)
        for e in output.scheduled
    ]


@pytest.mark.parametrize("fairness", ["off", "vtc"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_path_matches_general_path(fairness: str, seed: int) -> None:
    # 24 blocks of 4 tokens for up to 12 running requests: preemptions happen.
    fast = _scheduler(fairness, num_blocks=24, max_model_len=40)
    slow = _scheduler(fairness, num_blocks=24, max_model_len=40)
    assert isinstance(fast._plain, PlainDecode)
    slow._plain = None
    for scheduler in (fast, slow):
        for request in _requests(seed):
            scheduler.add_request(request)
    by_id = {s: {r.request_id: r for r in s.requests.values()} for s in (fast, slow)}
    rng_fast, rng_slow = random.Random(seed), random.Random(seed)
    finished: dict[str, tuple] = {}
    for step in range(200):
        if not fast.has_unfinished_requests():
            break
        out_fast, out_slow = fast.schedule(), slow.schedule()
        assert _entries(out_fast) == _entries(out_slow), step
        assert out_fast.preempted_request_ids == out_slow.preempted_request_ids
        assert out_fast.finished_request_ids == out_slow.finished_request_ids
        updated_fast = fast.update(out_fast, _sampled(out_fast, step, rng_fast))
        updated_slow = _general_update(slow, out_slow, _sampled(out_slow, step, rng_slow))
        assert [r.request_id for r in updated_fast] == [r.request_id for r in updated_slow]
        assert _state(fast) == _state(slow), step
        for a in updated_fast:
            b = by_id[slow][a.request_id]
            assert (a.output_token_ids, a.status, a.stop_reason) == (
                b.output_token_ids,
                b.status,
                b.stop_reason,
            )
            if a.is_finished():
                finished[a.request_id] = (a.status, a.stop_reason, len(a.output_token_ids))
    assert not fast.has_unfinished_requests() and not slow.has_unfinished_requests()
    # The workload reached every stop kind and preempted at least once.
    statuses = {status for status, _, _ in finished.values()}
    assert statuses == {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED}
    assert {reason for _, reason, _ in finished.values()} >= {None, STOP_ID}
    assert fast.num_preemptions_total > 0
    assert fast.fairness.drain_served() == slow.fairness.drain_served()


def _decode_one(scheduler: Scheduler, token: int) -> tuple[SchedulerOutput, Request]:
    out = scheduler.schedule()
    (entry,) = out.scheduled
    scheduler.update(out, ModelRunnerOutput(sampled_token_ids={entry.request_id: token}))
    return out, entry.request


def test_block_boundary_publishes_and_allocates() -> None:
    """A decode row that fills its last block publishes it (a later request with the same
    tokens hits it), and the next one gets a new block, through the fast path."""
    scheduler = _scheduler("off", num_blocks=16, max_model_len=64)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    scheduler.add_request(Request("a", [5, 6, 7], params))
    _decode_one(scheduler, 8)  # prefill: [5 6 7] computed, 8 sampled
    kv = scheduler.kv_cache_manager
    assert kv.num_cached_blocks.get("a", 0) == 0
    out, _ = _decode_one(scheduler, 9)  # computes token 8: block 0 [5 6 7 8] full
    assert out.scheduled[0].num_new_tokens == 1 and len(out.scheduled[0].block_ids) == 1
    assert kv.num_cached_blocks["a"] == 1
    out, _ = _decode_one(scheduler, 10)  # computes token 9: needs block 1
    assert len(out.scheduled[0].block_ids) == 2
    # A new request with the same first four tokens hits the published block.
    probe = Request("b", [5, 6, 7, 8, 11], params)
    hit_blocks, num_hit = kv.get_computed_blocks(probe)
    assert num_hit == 4 and [b.block_id for b in hit_blocks] == out.scheduled[0].block_ids[:1]


@pytest.mark.parametrize(
    ("params", "tokens", "status", "reason", "num_output"),
    [
        (dict(max_tokens=3, ignore_eos=True), [40, 41, 42, 43], "length", None, 3),
        (dict(max_tokens=None, ignore_eos=True), [40] * 40, "length", None, 20 - 5),
        (dict(max_tokens=9), [40, EOS], "stop", None, 2),
        (dict(max_tokens=9, ignore_eos=True), [40, EOS, 41], None, None, 3),
        (dict(max_tokens=9, stop_token_ids=[STOP_ID]), [40, STOP_ID], "stop", STOP_ID, 2),
        (
            dict(max_tokens=9, stop_token_ids=[STOP_ID], min_tokens=3),
            [STOP_ID] * 4,
            "stop",
            STOP_ID,
            3,
        ),
    ],
)
def test_stop_checks_fire_on_each_kind(params, tokens, status, reason, num_output) -> None:
    scheduler = _scheduler("off", num_blocks=16, max_model_len=20)
    sampling = SamplingParams(**params)
    sampling.update_from_generation_config({EOS})
    request = Request("r", [5, 6, 7, 8, 9], sampling)
    scheduler.add_request(request)
    for token in tokens:
        if request.is_finished():
            break
        _decode_one(scheduler, token)
    assert len(request.output_token_ids) == num_output
    assert request.get_finished_reason() == status
    assert request.stop_reason == reason
