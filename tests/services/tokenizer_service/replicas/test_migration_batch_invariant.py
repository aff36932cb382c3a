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


def _run(fleet: Fleet, fault, seed: int, reason: str):
    holder = fleet.engines[seed % 3]
    prompts = fleet.prompts_owned_by(holder, len(STREAMS), seed)
    reqs = [
        request(token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
        for p, sampling in zip(prompts, STREAMS, strict=True)
    ]
    before = fleet.migrations(reason)
    expected = run_undisturbed(fleet, reqs)
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


def _restart(fleet: Fleet, holder) -> None:
    holder.stop()
    holder.start()
    holder.wait_serving()
    fleet.wait_all_up()


def test_kill(fleet):
    holder = None
    try:
        holder = _run(fleet, lambda e: e.kill(), seed=1, reason="killed")
    finally:
        _restart(fleet, holder or fleet.engines[1])


def test_hang(fleet):
    holder = fleet.engines[2]
    try:
        _run(fleet, lambda e: os.kill(e.proc.pid, signal.SIGSTOP), seed=2, reason="stalled")
    finally:
        os.kill(holder.proc.pid, signal.SIGCONT)
    wait_for(lambda: fleet.idle(holder), timeout=120)
    fleet.wait_all_up()


def test_drain(fleet):
    try:
        holder = _run(fleet, lambda e: e.proc.terminate(), seed=3, reason="drained")
        assert holder.proc.wait(60) == 0
    finally:
        _restart(fleet, fleet.engines[0])
