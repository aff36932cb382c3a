"""A slow replica is not a stalled one, and streams are never abandoned with nowhere to go
(issue 45). Real engine processes behind one tokenizer service; the engines' steps are
slowed by the engine's test hook (engine/front/step_delay.py):

- busy: each step computes for seconds (its thread holds the CPU, as a long prefill on a
  loaded machine): the replica keeps its streams, alone and beside a healthy replica;
- idle: one step sleeps, making no progress while the process still answers (a wedged
  collective or driver): its streams wait for it when no other replica is up, and move
  when one is.

Stall timeouts are 1 s on both sides, far below the slowed steps.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from tests.services.helpers import request, wait_for
from tests.services.tokenizer_service.replicas.fleet import SHORT_GRACE, Fleet, Reader

STALL_TIMEOUT_S = 1.0
ENGINE_ARGS = (*SHORT_GRACE, "--engine-stall-timeout", str(STALL_TIMEOUT_S))
BUSY = {"PAGEDSERVE_TEST_STEP_DELAY": "busy:2.5"}  # every step with work: 2.5 s computing
WEDGED_ONCE = {"PAGEDSERVE_TEST_STEP_DELAY": "idle:6:1"}  # its first step: 6 s, no progress
MAX_TOKENS = 3
# FRESH: these engines start as `pagedserve engine` processes of their own, not forked from
# the test session's engine zygote (tests/services/engine_zygote.py): the stall rules they
# test read each process's CPU progress, and the busy test failed once in four runs while
# forked on a loaded machine, a cause not found; fresh starts cost ~50 s here.


def _streams(fleet: Fleet, holder, num: int, seed: int) -> list[Reader]:
    prompts = fleet.prompts_owned_by(holder, num, seed)
    return [
        Reader(
            fleet.public.Generate(
                request(token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0),
                timeout=300,
            )
        )
        for p in prompts
    ]


def _assert_all_complete(readers: list[Reader]) -> None:
    for reader in readers:
        error, outputs = reader.result()
        assert error is None, f"{error.code()}: {error.details()}"
        assert len(outputs[0].token_ids) == MAX_TOKENS


@pytest.fixture
def busy_fleet(tiny_model_dir) -> Iterator[Fleet]:
    fleet = Fleet(
        tiny_model_dir,
        num_engines=2,
        engine_args=ENGINE_ARGS,
        stall_timeout_s=STALL_TIMEOUT_S,
        engine_envs=[BUSY, {}],
        forked=False,  # fresh interpreters, as users start them: see FRESH below
    )
    yield fleet
    fleet.close()


def test_a_slow_busy_replica_keeps_its_streams_beside_a_healthy_one_and_alone(busy_fleet):
    fleet = busy_fleet
    slow, healthy = fleet.engines
    fleet.wait_all_up()
    for phase in ("beside a healthy replica", "alone"):
        readers = _streams(fleet, slow, 3, seed=len(phase))
        assert wait_for(lambda rs=readers: any(r.num_tokens() for r in rs), timeout=300)
        stayed_up = []
        while any(r.thread.is_alive() for r in readers):
            stayed_up.append(fleet.replica(slow).available)
            readers[0].thread.join(0.2)
        _assert_all_complete(readers)
        assert all(stayed_up), f"{phase}: the slow replica left routing"
        assert fleet.migrations("stalled") == 0, phase
        assert fleet.engine_details(slow).get("engine_stalled_s") is None, phase
        if phase.startswith("beside"):
            healthy.stop()
            wait_for(lambda: not fleet.replica(healthy).available, timeout=120)


def test_a_wedged_replica_keeps_its_streams_with_nowhere_to_go_and_moves_them_else(
    tiny_model_dir,
):
    fleet = Fleet(
        tiny_model_dir,
        num_engines=2,
        engine_args=ENGINE_ARGS,
        stall_timeout_s=STALL_TIMEOUT_S,
        engine_envs=[WEDGED_ONCE, {}],
        forked=False,
    )
    try:
        wedged, other = fleet.engines
        fleet.wait_all_up()
        # Alone: the streams wait out the wedged step (6 s > the 1 s stall timeout) and
        # complete there; nothing ends UNAVAILABLE, nothing moves. The wait is bounded by
        # each request's own deadline: one of 3 s ends DEADLINE_EXCEEDED.
        other.stop()
        wait_for(lambda: not fleet.replica(other).available, timeout=120)
        prompts = fleet.prompts_owned_by(wedged, 3, seed=1)
        short = Reader(
            fleet.public.Generate(
                request(token_ids=prompts[2], max_tokens=MAX_TOKENS, ignore_eos=True), timeout=3
            )
        )
        readers = _streams(fleet, wedged, 2, seed=1)
        wait_for(lambda: not fleet.replica(wedged).available, timeout=120)  # seen stalled
        _assert_all_complete(readers)
        error, _ = short.result()
        assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert fleet.migrations("stalled") == 0

        # With a healthy replica up, a wedged one's streams move to it.
        # Both processes start side by side (each start is mostly one core's work).
        other.start()
        wedged.stop()
        wedged.start()  # a fresh process: its first step wedges again
        other.wait_serving()
        wedged.wait_serving()
        fleet.wait_all_up()
        readers = _streams(fleet, wedged, 2, seed=2)
        _assert_all_complete(readers)
        assert fleet.migrations("stalled") >= 2
    finally:
        fleet.close()
