"""Scheduler tests without torch or a model: a fake runner samples fixed tokens."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from engine.api.sampling_params import SamplingParams
from engine.config.resolved import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from engine.core.scheduler import Scheduler

EOS = 2


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    policy: str = "fcfs",
    enable_chunked_prefill: bool = True,
    enable_caching: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        policy=policy,  # type: ignore[arg-type]
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching))


def make_request(
    request_id: str,
    num_prompt: int,
    max_tokens: int = 8,
    priority: int = 0,
    arrival: float = 0.0,
    first_token: int = 100,
    **params,
) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, **params)
    sampling.update_from_generation_config({EOS})
    prompt = [first_token + i for i in range(num_prompt)]
    return Request(request_id, prompt, sampling, arrival_time=arrival, priority=priority)


def fake_run(output: SchedulerOutput, token: int | dict[str, int] = 7) -> ModelRunnerOutput:
    result = ModelRunnerOutput()
    for entry in output.scheduled:
        if entry.samples:
            t = token if isinstance(token, int) else token.get(entry.request_id, 7)
            result.sampled_token_ids[entry.request_id] = t
    return result


def step(scheduler: Scheduler, token: int | dict[str, int] = 7) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update(output, fake_run(output, token))
    return output


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while scheduler.has_unfinished_requests():
        step(scheduler)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def test_scheduler_does_not_import_torch() -> None:
    code = (
        "import sys; import engine.core.scheduler, engine.core.kv_cache_manager; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_token_budget_and_max_num_seqs_are_respected() -> None:
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=10)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", num_prompt=6, first_token=100 * i))
    out = scheduler.schedule()
    # r0 takes 6 tokens, r1 the remaining 4 (a chunk); the budget is spent.
    assert [(e.request_id, e.num_new_tokens) for e in out.scheduled] == [("r0", 6), ("r1", 4)]
    assert out.num_scheduled_tokens == 10
    scheduler.update(out, fake_run(out))
    out = scheduler.schedule()
    # r0 decodes 1, r1 finishes its prompt (2), r2 joins with 6; r3 waits: max_num_seqs=3.
    assert [(e.request_id, e.num_new_tokens) for e in out.scheduled] == [
        ("r0", 1),
        ("r1", 2),
        ("r2", 6),
    ]
    assert len(scheduler.running) == 3
    assert all(out.num_scheduled_tokens <= 10 for out in [out])


def test_chunked_prefill_samples_only_at_the_end_of_the_prompt() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("long", num_prompt=20, max_tokens=2))
    chunks = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        chunks.append((out.scheduled[0].num_new_tokens, out.scheduled[0].samples))
        scheduler.update(out, fake_run(out))
    assert chunks == [(8, False), (8, False), (4, True), (1, True)]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False
    )
    scheduler.add_request(make_request("a", num_prompt=10))
    scheduler.add_request(make_request("b", num_prompt=10, first_token=300))
    out = scheduler.schedule()
    assert [(e.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 10)]


def test_priority_policy_schedules_higher_priority_first() -> None:
    scheduler = make_scheduler(policy="priority", max_num_seqs=1)
    for name, priority, arrival in [("low", 0, 1.0), ("urgent", 10, 2.0), ("mid", 5, 3.0)]:
        scheduler.add_request(
            make_request(name, 4, max_tokens=2, priority=priority, arrival=arrival)
        )
    order = []
    while scheduler.has_unfinished_requests():
        out = step(scheduler)
        for entry in out.scheduled:
            if entry.request_id not in order:
                order.append(entry.request_id)
    assert order == ["urgent", "mid", "low"]


def test_fcfs_ignores_priority_value_order() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("first", 4, max_tokens=1, arrival=1.0))
    scheduler.add_request(make_request("second", 4, max_tokens=1, arrival=2.0))
    assert scheduler.schedule().scheduled[0].request_id == "first"


def test_preemption_frees_blocks_and_requests_recompute() -> None:
    # 6 blocks of 4 tokens: two requests of 8 prompt + 8 output tokens cannot both fit.
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_model_len=24)
    a = make_request("a", 8, max_tokens=8, arrival=1.0)
    b = make_request("b", 8, max_tokens=8, arrival=2.0, first_token=300)
    scheduler.add_request(a)
    scheduler.add_request(b)
    preempted: set[str] = set()
    while scheduler.has_unfinished_requests():
        preempted |= step(scheduler).preempted_request_ids
    assert preempted == {"b"}  # the later arrival is the victim
    assert b.num_preemptions >= 1
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 6


def test_priority_preemption_evicts_the_lowest_priority() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_model_len=24, policy="priority")
    low = make_request("low", 8, max_tokens=8, priority=0, arrival=1.0)
    high = make_request("high", 8, max_tokens=8, priority=10, arrival=2.0, first_token=300)
    scheduler.add_request(low)
    scheduler.add_request(high)
    preempted: set[str] = set()
    while scheduler.has_unfinished_requests():
        preempted |= step(scheduler).preempted_request_ids
    assert preempted == {"low"}
    assert high.num_preemptions == 0
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 6


def test_abort_at_any_point_frees_every_block() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=6)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", 7, max_tokens=20, first_token=10 * i))
    step(scheduler)  # r0 partially prefilled
    scheduler.finish_requests("r0", RequestStatus.FINISHED_ABORTED)  # mid-prefill
    scheduler.finish_requests("r3", RequestStatus.FINISHED_ABORTED)  # still waiting
    reported: set[str] = set()
    for _ in range(6):
        reported |= step(scheduler).finished_request_ids
    scheduler.finish_requests(["r1", "r2", "missing"], RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)  # idempotent
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 8
    out = scheduler.schedule()
    # The runner hears of every finished request exactly once.
    assert out.is_empty and reported | out.finished_request_ids == {"r0", "r1", "r2", "r3"}


@pytest.mark.parametrize(
    ("params", "tokens", "status", "stop_reason", "num_out"),
    [
        ({}, [5, EOS, 5], RequestStatus.FINISHED_STOPPED, None, 2),
        ({"ignore_eos": True}, [5, EOS, 5, 5], RequestStatus.FINISHED_LENGTH_CAPPED, None, 4),
        ({"min_tokens": 3}, [EOS, EOS, EOS, 5], RequestStatus.FINISHED_STOPPED, None, 3),
        ({"stop_token_ids": [9]}, [5, 9, 5], RequestStatus.FINISHED_STOPPED, 9, 2),
        ({}, [5, 5, 5, 5, 5], RequestStatus.FINISHED_LENGTH_CAPPED, None, 4),
    ],
)
def test_stop_conditions(params, tokens, status, stop_reason, num_out) -> None:
    scheduler = make_scheduler()
    request = make_request("r", 4, max_tokens=4, **params)
    scheduler.add_request(request)
    for token in tokens:
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler, token)
    assert request.status == status
    assert request.stop_reason == stop_reason
    assert request.num_output_tokens == num_out


def test_max_model_len_caps_generation() -> None:
    scheduler = make_scheduler(max_model_len=10)
    request = make_request("r", 6, max_tokens=None)
    scheduler.add_request(request)
    run_to_completion(scheduler)
    assert request.num_tokens == 10
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_prefix_cache_hit_skips_computed_tokens() -> None:
    scheduler = make_scheduler(block_size=4)
    first = make_request("first", 10, max_tokens=1)
    scheduler.add_request(first)
    run_to_completion(scheduler)
    second = make_request("second", 10, max_tokens=1)
    scheduler.add_request(second)
    out = scheduler.schedule()
    # 8 of 10 prompt tokens are in two cached full blocks.
    assert out.scheduled[0].num_computed_tokens == 8 and out.scheduled[0].num_new_tokens == 2
    assert second.num_cached_tokens == 8


def test_prompt_logprobs_requests_skip_the_prefix_cache() -> None:
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("first", 10, max_tokens=1))
    run_to_completion(scheduler)
    scheduler.add_request(make_request("second", 10, max_tokens=1, prompt_logprobs=1))
    out = scheduler.schedule()
    assert out.scheduled[0].num_computed_tokens == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_never_leaks_blocks(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    num_blocks = 24
    scheduler = make_scheduler(
        num_blocks=num_blocks,
        block_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=rng.choice([8, 16, 32]),
        max_model_len=64,
        policy=policy,
    )
    live: list[str] = []
    finished: list[Request] = []
    for i in range(60):
        request = make_request(
            f"r{i}",
            rng.randint(1, 30),
            max_tokens=rng.randint(1, 20),
            priority=rng.randint(0, 3) if policy == "priority" else 0,
            arrival=float(i),
            first_token=rng.choice([100, 100, 500 + i]),  # some shared prefixes
        )
        scheduler.add_request(request)
        finished.append(request)
        live.append(request.request_id)
        for _ in range(rng.randint(0, 4)):
            if scheduler.has_unfinished_requests():
                out = step(scheduler, token=rng.choice([7, 7, 7, EOS]))
                assert out.num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
                assert len(scheduler.running) <= 6
        if rng.random() < 0.2:
            scheduler.finish_requests(rng.choice(live), RequestStatus.FINISHED_ABORTED)
    run_to_completion(scheduler)
    assert scheduler.kv_cache_manager.get_num_free_blocks() == num_blocks
    assert all(r.is_finished() for r in finished)
    for request in finished:
        if request.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            assert request.num_output_tokens == request.sampling_params.max_tokens
