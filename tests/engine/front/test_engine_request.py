"""A request's options travel as one `EngineRequest` (engine/core/engine_request.py) from
`LLMEngine.add_request` / `AsyncLLMEngine.generate` to the scheduler's `Request`: what the
caller gave arrives there as given, whichever door it came through, and a bad option is
refused at the door with its field's name. A tiny random Llama; no downloads."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from engine import AsyncLLMEngine, EngineArgs, LLMEngine, SamplingParams
from engine.core.engine_request import EngineRequest
from engine.core.request import Request
from tests.model_utils import make_tiny_llama

OPTIONS = {
    "arrival_time": 1234.5,
    "trace_headers": {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    "priority": 3,
    "fairness_key": "team-a",
    "fairness_weight": 2.5,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-engine-request"))


def engine_args(model_dir) -> EngineArgs:
    return EngineArgs(model=str(model_dir), max_model_len=128, scheduling_policy="priority")


def assert_carries_options(request: Request, parent_id: str) -> None:
    assert request.parent_id == parent_id
    assert request.arrival_time == OPTIONS["arrival_time"]
    assert request.trace_headers == OPTIONS["trace_headers"]
    assert request.priority == OPTIONS["priority"]
    assert request.fairness_key == OPTIONS["fairness_key"]
    assert request.fairness_weight == OPTIONS["fairness_weight"]


def test_add_request_options_reach_every_sample_of_the_scheduler(model_dir) -> None:
    engine = LLMEngine.from_engine_args(engine_args(model_dir))
    params = SamplingParams(n=2, max_tokens=2, seed=7)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, params, **OPTIONS)
    samples = [engine.scheduler.requests[f"r#{index}"] for index in range(2)]
    for index, sample in enumerate(samples):
        assert_carries_options(sample, "r")
        assert sample.index == index and sample.seed == 7 + index
    assert samples[0].sampling_params is not params  # the engine's own copy


def test_generate_hands_one_request_object_down_unchanged(model_dir) -> None:
    """The object `generate` built is the one the engine thread adds: nothing on the way
    re-reads its fields into keywords."""
    engine = AsyncLLMEngine.from_engine_args(engine_args(model_dir))
    seen: list[EngineRequest] = []
    add = engine.engine.add_engine_request

    def record(request: EngineRequest) -> None:
        seen.append(request)
        add(request)

    engine.engine.add_engine_request = record  # type: ignore[method-assign]
    options = {k: v for k, v in OPTIONS.items() if k != "arrival_time"}

    async def run() -> list[int]:
        params = SamplingParams(max_tokens=3, temperature=0.0)
        final = None
        async for output in engine.generate({"prompt_token_ids": [5, 6]}, params, "g", **options):
            final = output
        assert final is not None
        return final.outputs[0].token_ids

    try:
        assert len(asyncio.run(run())) == 3
    finally:
        engine.shutdown()
    assert len(seen) == 1
    request = seen[0]
    assert (request.request_id, request.priority) == ("g", options["priority"])
    assert (request.fairness_key, request.fairness_weight) == ("team-a", 2.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.priority = 0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("request_id", 5, TypeError),
        ("params", {"max_tokens": 2}, TypeError),
        ("priority", 1.5, TypeError),
        ("fairness_key", 3, TypeError),
        ("fairness_weight", 0.0, ValueError),
        ("fairness_weight", float("inf"), ValueError),
        ("fairness_weight", True, ValueError),
    ],
)
def test_a_bad_option_is_refused_naming_its_field(field, value, error) -> None:
    arguments = {"request_id": "x", "prompt": "hi", "params": SamplingParams()}
    arguments[field] = value
    with pytest.raises(error, match=field):
        EngineRequest.build(**arguments)


def test_defaults_are_filled_once_at_the_front() -> None:
    request = EngineRequest.build("x", "hi", SamplingParams(), fairness_weight=2)
    assert request.fairness_key == "" and request.fairness_weight == 2.0
    assert isinstance(request.fairness_weight, float) and request.arrival_time > 0
    assert request.trace_headers is None and request.resumed_output_token_ids is None
