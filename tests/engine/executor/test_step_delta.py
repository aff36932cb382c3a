"""The driver -> rank step description (engine/executor/step_delta.py), torch-free: the
ranks' mirror rebuilds exactly the scheduler's output while only changes are sent."""

from __future__ import annotations

import pickle

from engine.api.sampling_params import SamplingParams
from engine.config.resolved import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from engine.core.scheduler import Scheduler
from engine.executor.step_delta import RequestMirror, StepDeltaBuilder


def _view(output: SchedulerOutput) -> list[tuple]:
    return [
        (
            e.request_id,
            e.num_computed_tokens,
            e.num_new_tokens,
            list(e.block_ids),
            list(e.token_ids),
            list(e.spec_token_ids),
        )
        for e in output.scheduled
    ]


def _drive(scheduler: Scheduler, num_steps: int, hook=None) -> tuple[int, int]:
    """Runs the scheduler with made-up tokens; checks the mirror after each step. Returns
    (token ids and block ids sent, those the whole requests would have taken)."""
    builder, mirror = StepDeltaBuilder(vocab_size=128), RequestMirror()
    sent = whole = 0
    for step in range(num_steps):
        if hook is not None:
            hook(step)
        output = scheduler.schedule()
        if output.is_empty:
            builder.forget(output)
            continue
        delta = pickle.loads(pickle.dumps(builder.build(output)))  # as it crosses processes
        sent += sum(len(n.prompt_token_ids) + len(n.output_token_ids) for n in delta.new_requests)
        sent += sum(len(c.new_output_token_ids) + len(c.block_ids) for c in delta.scheduled)
        whole += sum(e.request.num_tokens + len(e.block_ids) for e in output.scheduled)
        rebuilt = mirror.apply(delta)
        assert _view(rebuilt) == _view(output)
        for entry in rebuilt.scheduled:  # the rank's copy of the request is the driver's
            driver = entry.request
            original = scheduler.requests.get(driver.request_id)
            if original is not None:
                assert driver.all_token_ids == original.all_token_ids
        runner_output = ModelRunnerOutput(
            sampled_token_ids={e.request_id: 3 + step % 50 for e in output.scheduled if e.samples}
        )
        scheduler.update(output, runner_output)
    return sent, whole


def _request(request_id: str, num_prompt: int, max_tokens: int = 30) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, list(range(5, 5 + num_prompt)), params, seed=1)


def test_mirror_follows_chunked_prefill_decode_and_preemption() -> None:
    manager = KVCacheManager(num_blocks=12, block_size=4, enable_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_model_len=64), manager)
    for i in range(4):
        scheduler.add_request(_request(f"r{i}", 6 + 3 * i))
    sent, whole = _drive(scheduler, 60)
    assert scheduler.num_preemptions_total > 0  # 12 blocks cannot hold four requests
    assert sent < whole / 3  # what changed, not whole requests


def test_sliding_window_tables_and_reused_ids() -> None:
    """Blocks dropped behind a sliding window change the table in place (sent whole);
    a finished id reused by a new request is a new request on the ranks."""
    manager = KVCacheManager(num_blocks=64, block_size=4, enable_caching=True, sliding_window=8)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_model_len=128), manager)
    scheduler.add_request(_request("a", 10, max_tokens=40))

    def reuse(step: int) -> None:
        if step == 5:
            scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
            scheduler.add_request(_request("a", 3, max_tokens=5))

    _drive(scheduler, 30, reuse)
