"""Engine Prometheus metrics: counts after traffic match what was sent."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine import EngineArgs, LLMEngine, SamplingParams
from tests.model_utils import make_tiny_llama


def scrape(engine: LLMEngine) -> dict[tuple[str, tuple], float]:
    text = generate_latest(engine.metrics.registry).decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values[(sample.name, labels)] = sample.value
    return values


def test_counters_and_histograms_match_the_traffic(tmp_path) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(make_tiny_llama(tmp_path))))
    prompts = [list(range(3, 3 + n)) for n in (4, 9, 17)]
    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"r{i}",
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        )
    engine.add_request("gone", {"prompt_token_ids": [50, 51]}, SamplingParams(max_tokens=50))
    engine.step()
    engine.abort_request("gone")
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    m = scrape(engine)
    assert m[("pagedserve:request_success_total", (("finished_reason", "length"),))] == 3
    assert m[("pagedserve:request_success_total", (("finished_reason", "abort"),))] == 1
    # Prompts 4, 9, 17 and 2; the repeated prefixes hit the cache, so fewer are computed.
    computed = m[("pagedserve:prompt_tokens_total", ())]
    hits = m[("pagedserve:prefix_cache_hits_total", ())]
    assert computed + hits == 4 + 9 + 17 + 2
    assert m[("pagedserve:prefix_cache_queries_total", ())] == 4 + 9 + 17 + 2
    # 5 tokens each for three requests, 1 for the aborted one before its abort.
    assert m[("pagedserve:generation_tokens_total", ())] == 16
    assert m[("pagedserve:request_prompt_tokens_count", ())] == 4
    assert m[("pagedserve:request_prompt_tokens_sum", ())] == 32
    assert m[("pagedserve:request_generation_tokens_sum", ())] == 16
    assert m[("pagedserve:time_to_first_token_seconds_count", ())] == 4
    assert m[("pagedserve:e2e_request_latency_seconds_count", ())] == 4
    assert m[("pagedserve:time_per_output_token_seconds_count", ())] == 3
    assert m[("pagedserve:num_requests_running", ())] == 0
    assert m[("pagedserve:kv_cache_usage_perc", ())] == 0.0
