"""The scheduler's placeholders under async scheduling (engine/core/async_scheduling.py),
without a model: step N+1 scheduled before step N's tokens arrive."""

from __future__ import annotations

import pytest

from engine.config.parallel import ParallelConfig
from engine.core.async_scheduling import overlap_blocker, unsupported_reason
from engine.core.request import RequestStatus
from tests.engine.core.test_scheduler import EOS, fake_run, make_request, make_scheduler


def async_scheduler(**kwargs):
    scheduler = make_scheduler(**kwargs)
    scheduler.async_scheduling = True
    return scheduler


def test_step_n_plus_1_decodes_a_placeholder() -> None:
    scheduler = async_scheduler()
    request = make_request("a", 5, max_tokens=8)
    scheduler.add_request(request)
    step_n = scheduler.schedule()
    out_n = fake_run(step_n, 30)  # computed as the runner would, before N+1 is scheduled
    step_n1 = scheduler.schedule()
    (entry,) = step_n1.scheduled
    assert (entry.num_computed_tokens, entry.num_new_tokens) == (5, 1)
    assert entry.num_placeholder_inputs == 1 and entry.token_ids == [0] and entry.samples
    assert request.num_output_placeholders == 2 and request.num_computed_tokens == 6
    assert entry.block_ids == scheduler.kv_cache_manager.get_block_ids("a")
    out_n1 = fake_run(step_n1, 31)
    scheduler.update(step_n, out_n)
    assert request.output_token_ids == [30] and request.num_output_placeholders == 1
    scheduler.update(step_n1, out_n1)
    assert request.output_token_ids == [30, 31] and request.num_output_placeholders == 0


def test_a_request_finished_at_step_n_drops_its_step_n_plus_1_token() -> None:
    scheduler = async_scheduler(num_blocks=8)
    free_at_start = scheduler.kv_cache_manager.get_num_free_blocks()
    request = make_request("a", 3, max_tokens=8)
    scheduler.add_request(request)
    step_n = scheduler.schedule()
    out_n = fake_run(step_n, EOS)
    step_n1 = scheduler.schedule()
    out_n1 = fake_run(step_n1, 40)
    assert scheduler.update(step_n, out_n) == [request]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert scheduler.update(step_n1, out_n1) == []  # its token is never emitted
    assert request.output_token_ids == [EOS]
    assert scheduler.kv_cache_manager.get_num_free_blocks() == free_at_start
    assert scheduler.schedule().finished_request_ids == {"a"}


def test_no_placeholder_step_past_max_tokens_or_max_model_len() -> None:
    scheduler = async_scheduler(max_model_len=6)
    last_token = make_request("tokens", 3, max_tokens=1)
    last_position = make_request("length", 5, max_tokens=8)
    for request in (last_token, last_position):
        scheduler.add_request(request)
    step_n = scheduler.schedule()
    assert len(step_n.scheduled) == 2
    assert scheduler.schedule().is_empty  # both surely finish with step N's token
    scheduler.update(step_n, fake_run(step_n))
    assert not scheduler.running


def test_preemption_drops_the_tokens_in_flight() -> None:
    scheduler = async_scheduler(num_blocks=3, block_size=4)
    first, second = make_request("a", 4, max_tokens=20), make_request("b", 4, max_tokens=20)
    scheduler.add_request(first)
    scheduler.add_request(second)
    step_n = scheduler.schedule()  # one block each
    out_n = fake_run(step_n)
    step_n1 = scheduler.schedule()  # both need a second block: "b" is preempted
    assert step_n1.preempted_request_ids == {"b"}
    assert second.num_output_placeholders == 0 and second.status == RequestStatus.PREEMPTED
    assert first.num_output_placeholders == 2
    scheduler.update(step_n, out_n)
    assert second.output_token_ids == []  # recomputed later, with its token
    assert first.output_token_ids == [7] and first.num_output_placeholders == 1


def test_overlap_blockers() -> None:
    scheduler = async_scheduler()
    plain = make_request("plain", 3, temperature=0.0)
    seeded = make_request("seeded", 3, temperature=0.9, seed=1, logprobs=2)
    for request in (plain, seeded):
        scheduler.add_request(request)
    step = scheduler.schedule()
    assert overlap_blocker(step, speculative=False) is None
    assert "speculative" in overlap_blocker(step, speculative=True)
    penalised = async_scheduler()  # counted on the device (engine/sample/penalty_state.py)
    penalised.add_request(make_request("penalty", 3, repetition_penalty=1.2, presence_penalty=1))
    penalty_step = penalised.schedule()
    assert "output so far" in overlap_blocker(penalty_step, speculative=False)
    assert overlap_blocker(penalty_step, speculative=False, penalties_on_device=True) is None
    for name, params, reason in [
        ("bad-words", {"bad_words_token_ids": [[4, 5]]}, "output so far"),
        ("min", {"min_tokens": 3}, "min_tokens"),
        ("prompt-lp", {"prompt_logprobs": 1}, "prompt logprobs"),
    ]:
        other = async_scheduler()
        other.add_request(make_request(name, 3, **params))
        assert reason in overlap_blocker(other.schedule(), speculative=False)


@pytest.mark.parametrize(
    "config",
    [
        ParallelConfig(pipeline_parallel_size=2),
        ParallelConfig(tensor_parallel_size=2),
        ParallelConfig(distributed_executor_backend="mp"),
    ],
)
def test_off_with_pipelines_and_rank_processes(config: ParallelConfig) -> None:
    assert unsupported_reason(config) is not None
    assert unsupported_reason(ParallelConfig()) is None
