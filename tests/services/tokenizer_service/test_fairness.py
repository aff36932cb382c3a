"""Fair sharing between tenants through the real services: two tenants (API keys), two
tokenizer replicas in front of one engine with a small batch. The heavy tenant floods the
engine through both replicas; the light tenant's one request must not wait behind the flood.

What is compared comes from the engine's own record (its `llm_request` spans: when each
request was first scheduled, and for which tenant), not from wall-clock bounds: under
first come, first served every heavy request queued before the light one starts before
it; under the engine's fair sharing none does.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pagedserve.v1 import common_pb2, engine_pb2, generation_pb2_grpc
from tests.services.conftest import ServiceStack
from tests.services.helpers import gather, request, wait_for

HEAVY = "heavy-key-0123456789abcdef00"
LIGHT = "light-key-0123456789abcdef00"
KEY_FILE = f"""\
{HEAVY}  heavy  weight=1
{LIGHT}  light  weight=1
"""
MAX_NUM_SEQS = 4
NUM_HEAVY = 24
FAIRNESS_KEY = "pagedserve.fairness_key"


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    """Installed before the engine starts, so that it records every request's span."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture(scope="module")
def replicas(spans, tiny_model_dir, tmp_path_factory):
    """One engine (batch of 4), two tokenizer replicas with the same key file."""
    stack = ServiceStack(tiny_model_dir, engine_args={"max_num_seqs": MAX_NUM_SEQS})
    key_file = tmp_path_factory.mktemp("fair-keys") / "api-keys"
    key_file.write_text(KEY_FILE)
    servers = [stack.start_tokenizer_server(api_key_file=str(key_file)) for _ in range(2)]
    channels = [grpc.insecure_channel(f"127.0.0.1:{s.port}") for s in servers]
    stubs = [generation_pb2_grpc.TextGenerationServiceStub(c) for c in channels]
    yield stack, stubs
    for channel in channels:
        channel.close()
    for server in servers:
        stack.loop.run(server.stop(0))
    stack.close()


def _generate(stub, key: str, request_id: str, prompt: list[int], max_tokens: int):
    metadata = [("authorization", f"Bearer {key}")]
    message = request(token_ids=prompt, request_id=request_id, max_tokens=max_tokens)
    message.sampling_params.ignore_eos = True
    return gather(stub.Generate(message, metadata=metadata, timeout=300))


def _first_scheduled(span) -> int:
    return next(e.timestamp for e in span.events if e.name == "first_scheduled")


def test_a_light_tenant_is_not_queued_behind_a_heavy_one(replicas, spans):
    stack, stubs = replicas
    spans.clear()
    results: dict[str, dict] = {}

    def heavy(i: int) -> None:  # through both replicas: the engine decides, not a replica
        prompt = [100 + i, 200 + i, 300 + i, 400 + i]
        results[f"h{i}"] = _generate(stubs[i % 2], HEAVY, f"h{i}", prompt, 40)

    threads = [threading.Thread(target=heavy, args=(i,)) for i in range(NUM_HEAVY)]
    for thread in threads:
        thread.start()
    # The flood is queued: the batch is full and most heavy requests wait.
    wait_for(lambda: stack.stats().num_waiting >= NUM_HEAVY // 2, timeout=120)
    num_waiting_before = stack.stats().num_waiting
    results["light"] = _generate(stubs[1], LIGHT, "l0", [7, 8, 9, 10], 4)
    for thread in threads:
        thread.join(300)
    assert len(results) == NUM_HEAVY + 1
    assert all(len(out[0].token_ids) == 40 for key, out in results.items() if key != "light")
    assert len(results["light"][0].token_ids) == 4

    engine_spans = [s for s in spans.get_finished_spans() if s.name == "llm_request"]
    by_tenant = {"heavy": [], "light": []}
    for span in engine_spans:
        by_tenant[span.attributes[FAIRNESS_KEY]].append(span)
    assert len(by_tenant["heavy"]) == NUM_HEAVY and len(by_tenant["light"]) == 1
    light = by_tenant["light"][0]
    light_arrival, light_start = light.start_time, _first_scheduled(light)
    # Heavy requests that were already queued when the light one arrived, and started
    # before it: FCFS would start every one of them (at least `num_waiting_before`).
    overtaking = [
        s
        for s in by_tenant["heavy"]
        if s.start_time < light_arrival and light_arrival <= _first_scheduled(s) < light_start
    ]
    assert num_waiting_before >= NUM_HEAVY // 2
    assert overtaking == [], [s.attributes["gen_ai.request.id"] for s in overtaking]
    # ... and the light tenant's tokens were counted under its own name at the engine.
    registry = stack.engine.engine.metrics.registry
    name = stack.engine.engine.config.model_config.served_model_name
    served = registry.get_sample_value(
        "pagedserve:tenant_served_tokens_total",
        {"model_name": name, "tenant": "light", "kind": "output"},
    )
    assert served == 4


def test_the_engine_refuses_a_bad_fairness_weight(replicas):
    stack, _ = replicas
    message = engine_pb2.EngineGenerateRequest(
        request_id="bad-weight",
        prompt_token_ids=[5, 6, 7],
        sampling_params=common_pb2.SamplingParams(max_tokens=2),
        fairness_key="t",
        fairness_weight=-1.0,
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stack.engine_stub.Generate(message, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "fairness_weight" in info.value.details()
