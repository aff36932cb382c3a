"""Fair sharing through the engine's API: fairness keys and weights on `add_request`, a
preemption under a tiny KV cache that takes from the key ahead of its share without
changing a token, and the per-tenant metrics. A tiny random Llama; no downloads."""

from __future__ import annotations

import pytest

from engine import EngineArgs, LLMEngine, RequestOutput, SamplingParams
from tests.model_utils import make_tiny_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-fair"), max_position_embeddings=128)


def make_engine(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(model=str(model_dir), block_size=4, max_model_len=128, **kwargs)
    )


def run(engine: LLMEngine, requests: list[tuple[str, str, float]]) -> dict[str, RequestOutput]:
    """(request id, fairness key, weight) each with its own 12-token prompt, to the end."""
    for number, (request_id, key, weight) in enumerate(requests):
        prompt = {"prompt_token_ids": [3 + (7 * number + i) % 120 for i in range(12)]}
        engine.add_request(request_id, prompt, GREEDY, fairness_key=key, fairness_weight=weight)
    finished = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert {request_id for request_id, _, _ in requests} <= finished.keys()
    return finished


# "ahead" has a quarter of "behind"'s weight, so it runs ahead of its share at once; it
# queued first, so FCFS would preempt "behind" (see test_fairness.py for that contrast).
REQUESTS = [
    ("a0", "ahead", 1.0),
    ("a1", "ahead", 1.0),
    ("b0", "behind", 4.0),
    ("b1", "behind", 4.0),
]


def test_preemption_takes_from_the_key_ahead_and_changes_no_output(model_dir) -> None:
    roomy = run(make_engine(model_dir), REQUESTS)
    engine = make_engine(model_dir, num_gpu_blocks_override=24)  # 4 x 42 tokens need 44
    tight = run(engine, REQUESTS)
    preempted = {rid for rid, o in tight.items() if o.metrics and o.metrics.num_preemptions}
    assert preempted and {rid[0] for rid in preempted} == {"a"}, preempted
    for request_id, output in roomy.items():
        assert tight[request_id].outputs[0].token_ids == output.outputs[0].token_ids
    assert engine.kv_cache_manager.get_num_free_blocks() == engine.get_cache_config().num_blocks


def test_served_tokens_and_counters_are_exported_per_tenant(model_dir) -> None:
    engine = make_engine(model_dir)
    registry, name = engine.metrics.registry, engine.config.model_config.served_model_name

    def sample(metric: str, **labels: str) -> float | None:
        return registry.get_sample_value(metric, {"model_name": name, **labels})

    prompt = {"prompt_token_ids": [125, 124, 123, 122]}  # shares no block with run()'s
    engine.add_request("w", prompt, GREEDY, fairness_key="tenant-b", fairness_weight=2.0)
    engine.step()  # its prompt: 4 tokens at weight 1 (and one output at 2), over weight 2
    assert sample("pagedserve:tenant_virtual_tokens", tenant="tenant-b") == (4 + 2) / 2
    run(engine, [("x", "tenant-a", 1.0), ("y", "tenant-b", 2.0), ("z", None, 1.0)])
    for tenant, num_prompt, num_output in [
        ("tenant-a", 12, 30),
        ("tenant-b", 16, 60),
        ("", 12, 30),
    ]:
        kind = "pagedserve:tenant_served_tokens_total"
        assert sample(kind, tenant=tenant, kind="prompt") == num_prompt, tenant
        assert sample(kind, tenant=tenant, kind="output") == num_output, tenant
    # Everything finished: the keys are forgotten, and so are their counters' series.
    assert sample("pagedserve:tenant_virtual_tokens", tenant="tenant-b") is None


def test_bad_fairness_arguments_are_refused(model_dir) -> None:
    engine = make_engine(model_dir)
    prompt = {"prompt_token_ids": [3, 4, 5]}
    with pytest.raises(ValueError, match="fairness_weight must be a positive"):
        engine.add_request("r", prompt, GREEDY, fairness_key="t", fairness_weight=0)
    with pytest.raises(TypeError, match="fairness_key must be a str"):
        engine.add_request("r", prompt, GREEDY, fairness_key=5)
    assert not engine.has_unfinished_requests()


def test_the_fairness_settings_reach_the_scheduler(model_dir) -> None:
    engine = make_engine(model_dir, fairness="off", fairness_output_token_weight=3.0)
    config = engine.scheduler.config
    assert (config.fairness, config.fairness_output_token_weight) == ("off", 3.0)
    assert engine.scheduler.fairness.output_weight == 3.0
