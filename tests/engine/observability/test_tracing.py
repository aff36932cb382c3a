"""The engine's `llm_request` span: parent from trace_headers, GenAI attributes, events."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from engine import EngineArgs, LLMEngine, SamplingParams
from engine.pooling_params import PoolingParams
from tests.model_utils import make_tiny_llama

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"

_EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    return _EXPORTER


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=128)


def run(engine: LLMEngine, steps: int = 500) -> list:
    outputs = []
    for _ in range(steps):
        outputs += engine.step()
        if not engine.has_unfinished_requests():
            break
    return outputs + engine.step()


def spans_for(exporter: InMemorySpanExporter, request_id: str):
    return [
        s
        for s in exporter.get_finished_spans()
        if s.name == "llm_request" and s.attributes.get("gen_ai.request.id") == request_id
    ]


def test_llm_request_span_is_a_child_of_the_callers_context(exporter, model_dir) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dir)))
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=20, max_tokens=7, ignore_eos=True)
    engine.add_request(
        "traced",
        {"prompt_token_ids": list(range(3, 14))},
        params,
        trace_headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1"},
    )
    (final,) = [o for o in run(engine) if o.finished]
    (span,) = spans_for(exporter, "traced")
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_SPAN_ID
    a = span.attributes
    assert a["gen_ai.request.model"] == str(model_dir)
    assert a["gen_ai.usage.input_tokens"] == 11 and a["gen_ai.usage.output_tokens"] == 7
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.top_k"]) == (0.5, 20)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.request.max_tokens"] == 7 and a["gen_ai.request.n"] == 1
    assert list(a["gen_ai.response.finish_reasons"]) == ["length"]
    queue, ttft, e2e = (
        a["gen_ai.latency.time_in_queue"],
        a["gen_ai.latency.time_to_first_token"],
        a["gen_ai.latency.e2e"],
    )
    assert 0 <= queue <= ttft <= e2e < 60
    assert a["gen_ai.latency.time_in_model_prefill"] >= 0
    assert a["gen_ai.latency.time_in_model_decode"] >= 0
    assert span.start_time == int(final.metrics.arrival_time * 1e9)
    assert [e.name for e in span.events] == ["first_scheduled", "first_token", "finished"]
    assert span.status.status_code != StatusCode.ERROR


def test_requests_without_context_are_not_traced_when_tracing_is_off(model_dir) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dir)))
    engine.recorder.tracing_enabled = False  # as in a process with no tracer provider
    engine.add_request("plain", {"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=2))
    assert not engine.recorder._live["plain"].traced
    run(engine)
    assert "plain" not in engine.recorder._live


def test_abort_and_preemption_are_recorded(exporter, model_dir) -> None:
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(model_dir), num_gpu_blocks_override=6, block_size=4)
    )
    headers = {"traceparent": TRACEPARENT}
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": list(range(3, 11))}, params, trace_headers=headers)
    engine.add_request(
        "b", {"prompt_token_ids": list(range(20, 28))}, params, trace_headers=headers
    )
    engine.add_request(
        "gone", {"prompt_token_ids": list(range(40, 44))}, params, trace_headers=headers
    )
    engine.step()
    engine.abort_request("gone")
    run(engine)
    (aborted,) = spans_for(exporter, "gone")
    assert aborted.status.status_code == StatusCode.ERROR
    assert list(aborted.attributes["gen_ai.response.finish_reasons"]) == ["abort"]
    preempted = [s for s in spans_for(exporter, "a") + spans_for(exporter, "b")]
    assert any(e.name == "preempted" for s in preempted for e in s.events)
    assert sum(s.attributes["pagedserve.request.num_preemptions"] for s in preempted) >= 1


def test_pooling_requests_are_traced_as_embeddings(exporter, model_dir) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dir)))
    engine.add_request(
        "embed",
        {"prompt_token_ids": [3, 4, 5, 6]},
        PoolingParams(),
        trace_headers={"traceparent": TRACEPARENT},
    )
    run(engine)
    (span,) = spans_for(exporter, "embed")
    assert span.attributes["gen_ai.operation.name"] == "embeddings"
    assert span.attributes["gen_ai.usage.input_tokens"] == 4


def test_llm_request_span_carries_the_lora_adapter(exporter, model_dir, tmp_path) -> None:
    from engine import LoRARequest
    from tests.lora_utils import make_peft_adapter

    make_peft_adapter(model_dir, tmp_path / "sql", rank=2, alpha=4, targets=["q_proj"], seed=1)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), enable_lora=True))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    headers = {"traceparent": TRACEPARENT}
    lora = LoRARequest("sql", 1, str(tmp_path / "sql"))
    prompt = {"prompt_token_ids": [5, 6]}
    engine.add_request("lora-span", prompt, params, lora_request=lora, trace_headers=headers)
    engine.add_request("base-span", prompt, params, trace_headers=headers)
    run(engine)
    (span,) = spans_for(exporter, "lora-span")
    assert span.attributes["gen_ai.request.lora_name"] == "sql"
    (base,) = spans_for(exporter, "base-span")
    assert "gen_ai.request.lora_name" not in base.attributes


def test_engine_args_carry_the_otlp_endpoint(model_dir) -> None:
    # The engine sets up its exporter from EngineConfig.otlp_traces_endpoint: EngineArgs
    # (and so LLM(...) and `pagedserve engine --otlp-traces-endpoint`) must hand it on.
    args = EngineArgs(model=str(model_dir), otlp_traces_endpoint="http://127.0.0.1:4317")
    assert args.create_engine_config().otlp_traces_endpoint == "http://127.0.0.1:4317"
    assert EngineArgs(model=str(model_dir)).create_engine_config().otlp_traces_endpoint is None
