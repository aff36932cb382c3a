"""Streams that survive their replica (issue 34): three engine processes behind one tokenizer
service; the replica holding greedy, seeded and n=2 streams is SIGKILLed, SIGSTOPped or
SIGTERMed midway, and every stream completes as if nothing had happened.

Why real processes: the failures are the processes' own (a dead socket, a frozen process
whose connections stay open, an engine that drains and hands its streams back). Each stream
is compared with the same request run undisturbed beforehand: exact tokens (greedy and
seeded on the tiny fp32 model; greedy up to DESIGN.md's top-5 criterion, since the
undisturbed run batches differently and a random model has near-ties) and text, and usage
counting the whole output.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import grpc
import pytest

from pagedserve.v1 import common_pb2
from tests.services.helpers import request, wait_for
from tests.services.processes import EngineProcess
from tests.services.tokenizer_service.replicas.fleet import (
    Fleet,
    Reader,
    assert_greedy_match,
    assert_text_is_the_tokens,
    run_undisturbed,
)

# Midway when the fault comes: it comes after 8 tokens, and a drain (`SHORT_GRACE`, 0.2 s)
# runs the streams on for tens of tokens, not hundreds (test_migration_batch_invariant.py
# drains 200-token streams). Each stream runs twice, undisturbed and faulted.
MAX_TOKENS = 300
STALL_TIMEOUT_S = 2.0  # the test's --engine-stall-timeout: a SIGSTOP is noticed quickly
# Greedy, seeded sampling, and two seeded samples (seed + i each). The seeded ones sample
# among the top 5: this random model's distribution over its whole vocabulary is nearly
# flat, so the resumed prefill's float noise (not the RNG's position, which a wrong resume
# would change at every token) could move the sampled id to its neighbour at a boundary.
STREAMS = (
    {"temperature": 0.0, "logprobs": 5},  # greedy: the top-5 check needs them
    {"temperature": 1.0, "seed": 1234, "top_k": 5},
    {"temperature": 0.8, "seed": 99, "n": 2, "top_k": 5},
)
FAULT_SEEDS = (1, 2, 3)  # SIGKILL, SIGSTOP, SIGTERM: holders engines[1], [2] and [0]


@pytest.fixture(scope="module")
def fleet(tiny_model_dir) -> Iterator[Fleet]:
    fleet = Fleet(tiny_model_dir, stall_timeout_s=STALL_TIMEOUT_S)
    yield fleet
    fleet.close()


@pytest.fixture
def all_up(fleet: Fleet) -> Fleet:
    """The three replicas running, an earlier test's victim started again."""
    fleet.revive()
    return fleet


def _requests(fleet: Fleet, holder: EngineProcess, seed: int):
    prompts = fleet.prompts_owned_by(holder, len(STREAMS), seed)
    return [
        request(token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
        for p, sampling in zip(prompts, STREAMS, strict=True)
    ]


@pytest.fixture(scope="module")
def undisturbed(fleet: Fleet) -> dict[int, tuple[list, list]]:
    """Each fault test's requests (by seed) and their outputs run undisturbed. The three
    tests' streams have three different holders, so they run in one go, side by side, each
    batch on its own replica as it would run alone: one stream's time, not three."""
    reqs = {seed: _requests(fleet, fleet.engines[seed % 3], seed) for seed in FAULT_SEEDS}
    outputs = iter(run_undisturbed(fleet, [r for seed in FAULT_SEEDS for r in reqs[seed]]))
    return {seed: (reqs[seed], [next(outputs) for _ in reqs[seed]]) for seed in FAULT_SEEDS}


def _run_with_fault(fleet: Fleet, undisturbed, fault, seed: int):
    """The streams again with `fault(holder)` midway: the undisturbed and faulted results."""
    holder = fleet.engines[seed % 3]
    reqs, expected = undisturbed[seed]
    readers = [Reader(fleet.public.Generate(r, timeout=300)) for r in reqs]
    # Midway: every stream has tokens, and the holder is the one producing them.
    wait_for(lambda: all(r.num_tokens() >= 8 for r in readers), timeout=120, interval=0.001)
    assert fleet.replica(holder).watch.streams, "the streams are not on the holder"
    fault(holder)
    results = [r.result() for r in readers]
    return holder, expected, results


def _assert_complete_and_equal(fleet: Fleet, expected, results) -> None:
    for want, (error, got) in zip(expected, results, strict=True):
        assert error is None, error
        assert sorted(got) == sorted(want)
        for index, out in got.items():
            assert out.finish_reason == common_pb2.FINISH_REASON_LENGTH
            if out.logprobs:  # greedy
                assert_greedy_match(out, want[index])
            else:
                assert out.token_ids == want[index].token_ids  # seeded: exact
            assert len(out.token_ids) == out.usage.completion_tokens == MAX_TOKENS
            if out.token_ids == want[index].token_ids:
                assert out.text == want[index].text  # nothing sent twice, nothing lost
            assert_text_is_the_tokens(fleet, out)


def test_sigkill_moves_the_streams_and_they_complete_unchanged(all_up, undisturbed):
    fleet = all_up
    before = fleet.migrations("killed")
    holder, expected, results = _run_with_fault(fleet, undisturbed, lambda e: e.kill(), seed=1)
    _assert_complete_and_equal(fleet, expected, results)
    assert fleet.migrations("killed") >= before + len(STREAMS)
    survivors = [e for e in fleet.engines if e is not holder]
    for engine in survivors:
        wait_for(lambda engine=engine: fleet.idle(engine), timeout=60)


def test_sigstop_is_a_stall_and_the_continued_replica_frees_the_moved_requests(all_up, undisturbed):
    fleet = all_up
    before = fleet.migrations("stalled")
    holder, expected, results = _run_with_fault(
        fleet, undisturbed, lambda e: os.kill(e.proc.pid, signal.SIGSTOP), seed=2
    )
    try:
        _assert_complete_and_equal(fleet, expected, results)
        assert fleet.migrations("stalled") >= before + len(STREAMS)
        assert not fleet.replica(holder).available
    finally:
        os.kill(holder.proc.pid, signal.SIGCONT)
    # It runs again: the moved requests' calls were cancelled, so it aborts them and frees
    # their blocks, and the tokenizer service takes it back.
    wait_for(lambda: fleet.idle(holder), timeout=120)
    for engine in fleet.engines:
        wait_for(lambda engine=engine: fleet.idle(engine), timeout=60)
    fleet.wait_all_up()


def test_sigterm_drains_and_hands_the_streams_back(all_up, undisturbed):
    fleet = all_up
    before = fleet.migrations("drained")
    holder, expected, results = _run_with_fault(
        fleet, undisturbed, lambda e: e.proc.terminate(), seed=3
    )
    try:
        _assert_complete_and_equal(fleet, expected, results)
        assert fleet.migrations("drained") >= before + len(STREAMS)
        assert holder.proc.wait(60) == 0  # a drain is a clean exit
        for engine in fleet.engines:
            if engine is not holder:
                wait_for(lambda engine=engine: fleet.idle(engine), timeout=60)
    finally:
        holder.stop()  # (a no-op once it has exited; started again by `all_up`)


def test_a_replica_restarted_with_a_smaller_cache_is_reread_and_limits_follow_it(fleet):
    """GetModelInfo used to report the old engine's KV blocks after it came back smaller."""
    info = fleet.public.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10)
    old = fleet.engines[1]
    old.kill()
    small = fleet.engines[1] = EngineProcess(
        old.model_dir, old.port, "--kv-cache-memory-bytes", str(1 << 20), forked=True
    )
    fleet.revive()  # the small one, beside any replica an earlier test left down
    own = fleet.replica(small).model_info
    assert own.num_kv_blocks < info.num_kv_blocks

    def reported():
        return fleet.public.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10)

    wait_for(lambda: reported().num_kv_blocks == own.num_kv_blocks, timeout=30)
    assert reported().effective_max_model_len == own.effective_max_model_len
    details = fleet.public.Health(common_pb2.HealthRequest(), timeout=10).details
    assert f"num_kv_blocks={own.num_kv_blocks}" in details[f"replica.{small.address}"]


def test_every_replica_killed_ends_the_streams_unavailable(all_up):
    fleet = all_up
    holder = fleet.engines[0]
    readers = [Reader(fleet.public.Generate(r, timeout=300)) for r in _requests(fleet, holder, 4)]
    wait_for(lambda: all(r.num_tokens() >= 8 for r in readers), timeout=120, interval=0.001)
    for engine in fleet.engines:
        engine.kill()
    for reader in readers:
        error, _ = reader.result()  # never hangs
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
