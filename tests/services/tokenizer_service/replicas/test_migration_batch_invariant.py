"""Migration under `--batch-invariant` (docs/determinism.md): the replicas run batch-
invariant, so a stream moved off a killed, hung or draining replica and resumed elsewhere
(its prompt plus the tokens so far prefilled anew, beside other streams) continues with the
bits of the undisturbed run: greedy tokens and logprobs and seeded tokens (top_p sampling
over the whole vocabulary, no top_k guard) equal exactly, with no top-5 allowance.

One fleet of three real engine processes behind one tokenizer service, as test_migration.py,
and shorter streams: what is checked is equality, not endurance.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from pagedserve.v1 import common_pb2
from tests.services.helpers import request, wait_for
from tests.services.tokenizer_service.replicas.fleet import (
    SHORT_GRACE,
    Fleet,
    Reader,
    run_undisturbed,
)

MAX_TOKENS = 200
STREAMS = (
    {"temperature": 0.0, "logprobs": 3},
    {"temperature": 0.8, "top_p": 0.95, "seed": 1234, "logprobs": 3},
    {"temperature": 0.8, "top_p": 0.95, "seed": 99, "n": 2},
    {"temperature": 1.0, "seed": 7},
)
FAULT_SEEDS = (1, 2, 3)  # SIGKILL, hang, drain: holders engines[1], [2] and [0]


@pytest.fixture(scope="module")
def fleet(tiny_model_dir) -> Iterator[Fleet]:
    fleet = Fleet(tiny_model_dir, engine_args=(*SHORT_GRACE, "--batch-invariant"))
    yield fleet
    fleet.close()


def _bits(out) -> tuple:
    """Everything a stream produced that could differ: tokens, logprobs, finish."""
    logprobs = [
        (p.chosen.token_id, p.chosen.logprob, [(t.token_id, t.logprob) for t in p.top])
        for p in out.logprobs
    ]
    return list(out.token_ids), logprobs, out.finish_reason, out.text


def _requests(fleet: Fleet, seed: int) -> list:
    prompts = fleet.prompts_owned_by(fleet.engines[seed % 3], len(STREAMS), seed)
    return [
        request(token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
        for p, sampling in zip(prompts, STREAMS, strict=True)
    ]


@pytest.fixture(scope="module")
def undisturbed(fleet: Fleet) -> dict[int, tuple[list, list]]:
    """Each test's requests (by seed) and their outputs run undisturbed, all in one go: the
    three tests' streams have three different holders, so each batch runs on its own
    replica as it would alone (batch invariance makes the batch moot anyway)."""
    reqs = {seed: _requests(fleet, seed) for seed in FAULT_SEEDS}
    outputs = iter(run_undisturbed(fleet, [r for seed in FAULT_SEEDS for r in reqs[seed]]))
    return {seed: (reqs[seed], [next(outputs) for _ in reqs[seed]]) for seed in FAULT_SEEDS}


def _run(fleet: Fleet, undisturbed, fault, seed: int, reason: str):
    holder = fleet.engines[seed % 3]
    reqs, expected = undisturbed[seed]
    before = fleet.migrations(reason)
    readers = [Reader(fleet.public.Generate(r, timeout=300)) for r in reqs]
    wait_for(lambda: all(r.num_tokens() >= 8 for r in readers), timeout=120, interval=0.001)
    assert fleet.replica(holder).watch.streams, "the streams are not on the holder"
    fault(holder)
    results = [r.result() for r in readers]
    for want, (error, got) in zip(expected, results, strict=True):
        assert error is None, error
        assert sorted(got) == sorted(want)
        for index, out in got.items():
            assert out.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert _bits(out) == _bits(want[index]), f"stream {index} differs after the move"
    assert fleet.migrations(reason) >= before + len(STREAMS)
    return holder


@pytest.fixture
def all_up(fleet: Fleet) -> Fleet:
    """The three replicas running, an earlier test's victim started again."""
    fleet.revive()
    return fleet


def test_kill(all_up, undisturbed):
    _run(all_up, undisturbed, lambda e: e.kill(), seed=1, reason="killed")


def test_hang(all_up, undisturbed):
    fleet = all_up
    holder = fleet.engines[2]
    try:
        _run(
            fleet,
            undisturbed,
            lambda e: os.kill(e.proc.pid, signal.SIGSTOP),
            seed=2,
            reason="stalled",
        )
    finally:
        os.kill(holder.proc.pid, signal.SIGCONT)
    wait_for(lambda: fleet.idle(holder), timeout=120)
    fleet.wait_all_up()


def test_drain(all_up, undisturbed):
    holder = all_up.engines[0]
    try:
        _run(all_up, undisturbed, lambda e: e.proc.terminate(), seed=3, reason="drained")
        assert holder.proc.wait(60) == 0
    finally:
        holder.stop()  # (a no-op once it has exited)
