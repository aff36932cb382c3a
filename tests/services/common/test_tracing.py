"""One trace from the client through both services to the engine's `llm_request` span.

Both services run in this process (the session's `stack`), so an in-memory exporter on the
process's tracer provider sees the spans of both; they are told apart by name.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pagedserve.v1 import common_pb2, engine_pb2
from services.common.tracing import tracing_requested
from tests.services.helpers import gather, request, token_prompts, wait_for

PUBLIC_GENERATE = "pagedserve.v1.TextGenerationService/Generate"
ENGINE_GENERATE = "pagedserve.v1.EngineService/Generate"
PROMPT = token_prompts(1, seed=7)[0]

_EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    """The process's SDK provider (tests/engine/observability/test_tracing.py may have
    installed it; a global provider can be set only once), with our exporter added."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    return _EXPORTER


def _new_traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _trace(exporter: InMemorySpanExporter, trace_id: int) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]


def _spans_of(exporter, trace_id: int, expected: int) -> dict[tuple[str, SpanKind], ReadableSpan]:
    """The trace's spans by (name, kind), once all `expected` have ended (the servers end
    their RPC spans just after the last message)."""
    spans = wait_for(lambda: (s := _trace(exporter, trace_id)) and len(s) >= expected and s)
    by_key = {(s.name, s.kind): s for s in spans}
    assert len(by_key) == len(spans) == expected, sorted(by_key, key=str)
    return by_key


def _request_span(exporter, request_id: str) -> ReadableSpan:
    def find():
        return [
            s
            for s in exporter.get_finished_spans()
            if s.name == PUBLIC_GENERATE and s.attributes.get("gen_ai.request.id") == request_id
        ]

    (span,) = wait_for(find)
    return span


def _ancestors(span: ReadableSpan, spans: list[ReadableSpan]) -> list[int]:
    """Span ids from `span`'s parent up to the first one that is not in `spans`."""
    by_id = {s.context.span_id: s for s in spans}
    chain = []
    while span.parent is not None:
        chain.append(span.parent.span_id)
        if span.parent.span_id not in by_id:
            break
        span = by_id[span.parent.span_id]
    return chain


def _generate(stack, req, metadata=()):
    return gather(stack.public.Generate(req, metadata=metadata, timeout=60))


TREE = [
    # (name, kind) -> (parent name, parent kind)
    (("tokenize", SpanKind.INTERNAL), (PUBLIC_GENERATE, SpanKind.SERVER)),
    ((ENGINE_GENERATE, SpanKind.CLIENT), (PUBLIC_GENERATE, SpanKind.SERVER)),
    (("detokenize", SpanKind.INTERNAL), (PUBLIC_GENERATE, SpanKind.SERVER)),
    ((ENGINE_GENERATE, SpanKind.SERVER), (ENGINE_GENERATE, SpanKind.CLIENT)),
    (("llm_request", SpanKind.SERVER), (ENGINE_GENERATE, SpanKind.SERVER)),
]


def _check_tree(spans: dict) -> None:
    for child, parent in TREE:
        assert spans[child].parent.span_id == spans[parent].context.span_id, (child, parent)


@pytest.mark.parametrize("via", ["metadata", "trace_headers", "both"])
def test_client_context_continues_through_both_services(stack, exporter, via):
    traceparent, trace_id, client_span_id = _new_traceparent()
    request_id = f"traced-{via}"
    req = request(
        token_ids=PROMPT,
        request_id=request_id,
        temperature=0.5,
        top_p=0.9,
        top_k=20,
        max_tokens=5,
        ignore_eos=True,
    )
    metadata = []
    if via in ("metadata", "both"):
        metadata.append(("traceparent", traceparent))
        metadata.append(("tracestate", "client=1"))
    if via == "trace_headers":
        req.trace_headers["traceparent"] = traceparent
    if via == "both":  # the metadata wins
        req.trace_headers["traceparent"] = _new_traceparent()[0]
    outputs = _generate(stack, req, metadata)
    assert len(outputs[0].token_ids) == 5

    spans = _spans_of(exporter, int(trace_id, 16), expected=6)
    root = spans[(PUBLIC_GENERATE, SpanKind.SERVER)]
    assert format(root.parent.span_id, "016x") == client_span_id and root.parent.is_remote
    _check_tree(spans)
    llm_request = spans[("llm_request", SpanKind.SERVER)]
    all_spans = list(spans.values())
    assert format(_ancestors(llm_request, all_spans)[-1], "016x") == client_span_id
    if via != "trace_headers":  # the client's tracestate travels with the context
        assert dict(llm_request.context.trace_state) == {"client": "1"}

    engine_rpc = spans[(ENGINE_GENERATE, SpanKind.SERVER)]
    # The request went over the replica's multiplexed call (the default): the context in
    # its trace_headers made the engine's span a child of the tokenizer's CLIENT span.
    assert engine_rpc.attributes["pagedserve.engine_stream"] is True
    for span in (root, engine_rpc, llm_request):
        a = span.attributes
        assert a["gen_ai.request.id"] == request_id, span.name
        assert a["gen_ai.request.model"] == str(stack.model_dir), span.name
        assert (a["gen_ai.request.temperature"], a["gen_ai.request.top_k"]) == (0.5, 20)
        assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
        assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.n"]) == (5, 1)
        assert a["gen_ai.usage.input_tokens"] == len(PROMPT), span.name
        assert a["gen_ai.usage.output_tokens"] == 5, span.name
        assert list(a["gen_ai.response.finish_reasons"]) == ["length"], span.name
        assert span.status.status_code == StatusCode.UNSET, (span.name, span.status)
    for span in (root, engine_rpc):
        assert span.attributes["rpc.grpc.status_code"] == 0
        assert span.attributes["rpc.system"] == "grpc"
    assert root.attributes["rpc.method"] == "Generate"
    # Nested in time as in the tree.
    assert root.start_time <= engine_rpc.start_time <= llm_request.start_time
    assert llm_request.end_time <= engine_rpc.end_time <= root.end_time


def test_call_without_context_starts_a_new_trace(stack, exporter):
    _generate(stack, request(token_ids=PROMPT, request_id="untraced", max_tokens=3))
    root = _request_span(exporter, "untraced")
    assert root.parent is None
    spans = _spans_of(exporter, root.context.trace_id, expected=6)
    _check_tree(spans)
    assert spans[("llm_request", SpanKind.SERVER)].attributes["gen_ai.usage.output_tokens"] == 3


def test_invalid_request_sets_the_error_status(stack, exporter):
    traceparent, trace_id, _ = _new_traceparent()
    with pytest.raises(grpc.RpcError) as info:
        _generate(stack, request(token_ids=PROMPT, top_p=0.0), [("traceparent", traceparent)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The engine checks sampling values (one rule, one message on every path): the RPC,
    # tokenize, the engine call (CLIENT), detokenize and the engine service's RPC.
    spans = _spans_of(exporter, int(trace_id, 16), expected=5)
    root = spans[(PUBLIC_GENERATE, SpanKind.SERVER)]
    assert root.status.status_code == StatusCode.ERROR
    assert root.status.description.startswith("INVALID_ARGUMENT: sampling_params.top_p")
    assert root.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    engine = spans[(ENGINE_GENERATE, SpanKind.SERVER)]
    assert engine.status.description == root.status.description  # passed through unchanged
    assert spans[(ENGINE_GENERATE, SpanKind.CLIENT)].status.status_code == StatusCode.ERROR

    # The engine service's own errors, called directly.
    traceparent, trace_id, _ = _new_traceparent()
    bad = engine_pb2.EngineGenerateRequest(prompt_token_ids=PROMPT)  # no request_id
    with pytest.raises(grpc.RpcError):
        list(stack.engine_stub.Generate(bad, metadata=[("traceparent", traceparent)]))
    (span,) = wait_for(lambda: _trace(exporter, int(trace_id, 16)))
    assert (span.name, span.kind) == (ENGINE_GENERATE, SpanKind.SERVER)
    assert span.status.status_code == StatusCode.ERROR
    assert span.status.description == "INVALID_ARGUMENT: request_id must not be empty"


def _generate_with_timeout(stack, req, traceparent: str, timeout: float) -> None:
    gather(stack.public.Generate(req, metadata=[("traceparent", traceparent)], timeout=timeout))


def _start_long_stream(stack, request_id: str, traceparent: str):
    req = request(token_ids=PROMPT, request_id=request_id, max_tokens=2000, ignore_eos=True)
    call = stack.public.Generate(req, metadata=[("traceparent", traceparent)], timeout=60)
    first = next(call)  # the request is live at the engine
    return call, first


def test_abort_rpc_is_recorded(stack, exporter):
    traceparent, trace_id, _ = _new_traceparent()
    call, _ = _start_long_stream(stack, "to-abort", traceparent)
    rest: dict = {}
    reader = threading.Thread(target=lambda: rest.update(gather(call)))
    reader.start()
    reply = stack.public.Abort(common_pb2.AbortRequest(request_ids=["to-abort"]))
    assert list(reply.aborted_request_ids) == ["to-abort"]
    reader.join(60)
    assert rest[0].finish_reason == common_pb2.FINISH_REASON_ABORT

    spans = _spans_of(exporter, int(trace_id, 16), expected=6)
    _check_tree(spans)
    for key in ((PUBLIC_GENERATE, SpanKind.SERVER), (ENGINE_GENERATE, SpanKind.SERVER)):
        span = spans[key]
        assert list(span.attributes["gen_ai.response.finish_reasons"]) == ["abort"], key
        assert span.status.status_code == StatusCode.ERROR, key
        assert span.status.description == "request aborted"
        assert "aborted" in [e.name for e in span.events]
        assert span.attributes["rpc.grpc.status_code"] == 0  # the stream itself ended well
    assert spans[("llm_request", SpanKind.SERVER)].status.status_code == StatusCode.ERROR

    # The Abort RPC has its own trace (no context sent): the engine's Abort is its child.
    def abort_spans():
        found = {
            s.name: s
            for s in exporter.get_finished_spans()
            if s.name.endswith("/Abort")
            and "to-abort" in s.attributes.get("pagedserve.abort.request_ids", ())
        }
        return len(found) == 2 and found

    found = wait_for(abort_spans)
    public_abort = found["pagedserve.v1.TextGenerationService/Abort"]
    engine_abort = found["pagedserve.v1.EngineService/Abort"]
    assert engine_abort.parent.span_id == public_abort.context.span_id
    assert public_abort.status.status_code == StatusCode.UNSET
    stack.wait_until_idle()


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_cancelled_stream_is_recorded(stack, exporter, how, monkeypatch):
    traceparent, trace_id, _ = _new_traceparent()
    if how == "cancel":
        call, _ = _start_long_stream(stack, "to-cancel", traceparent)
        call.cancel()
        expected = grpc.StatusCode.CANCELLED
    else:
        # The engine's steps are held until the deadline has passed: the request reaches
        # the engine well within the 5 s however loaded the machine, and the deadline, not
        # the end of its tokens, ends it.
        entered, release = threading.Event(), threading.Event()
        runner = stack.engine.engine.runner
        real_execute = runner.launch  # what the executor calls per step

        def held_execute(scheduler_output):
            entered.set()
            release.wait(120)
            return real_execute(scheduler_output)

        monkeypatch.setattr(runner, "launch", held_execute)
        req = request(token_ids=PROMPT, max_tokens=2000, ignore_eos=True)
        try:
            with pytest.raises(grpc.RpcError) as info:
                _generate_with_timeout(stack, req, traceparent, timeout=5.0)
        finally:
            release.set()
            monkeypatch.undo()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert entered.is_set(), "the deadline passed before the request reached the engine"
        expected = grpc.StatusCode.DEADLINE_EXCEEDED
    spans = _spans_of(exporter, int(trace_id, 16), expected=6)
    _check_tree(spans)
    public = spans[(PUBLIC_GENERATE, SpanKind.SERVER)]
    assert public.status.description.startswith(expected.name)
    for key in ((PUBLIC_GENERATE, SpanKind.SERVER), (ENGINE_GENERATE, SpanKind.SERVER)):
        span = spans[key]
        assert span.status.status_code == StatusCode.ERROR, key
        # The engine call is cancelled by the tokenizer service (or its deadline passes).
        assert span.status.description.startswith(("CANCELLED", "DEADLINE_EXCEEDED")), key
        assert span.attributes["rpc.grpc.status_code"] != 0
    assert "cancelled" in [e.name for e in public.events] or how == "deadline"
    assert spans[("llm_request", SpanKind.SERVER)].attributes["gen_ai.response.finish_reasons"] == (
        "abort",
    )
    stack.wait_until_idle()


# ---- set-up from the environment ----------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_tracing_requested(environ, expected):
    assert tracing_requested(environ) is expected


_SETUP_SCRIPT = """
from opentelemetry import context, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from services.common import tracing

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
# Off: no provider; spans are non-recording and the caller's context passes through.
assert tracing.setup_tracing("pagedserve-x") is None
assert not isinstance(trace.get_tracer_provider(), TracerProvider)
incoming = {"traceparent": TP, "tracestate": "a=1", "other": "x"}
context.attach(TraceContextTextMapPropagator().extract(incoming))
span = tracing.start_client_span("call")
assert not span.is_recording()
assert tracing.outgoing_trace_headers(incoming, span) == incoming
assert tracing.outgoing_trace_headers({}) == {"traceparent": TP, "tracestate": "a=1"}

# On, from the standard variables only.
import os
os.environ.update(OTEL_TRACES_EXPORTER="console", OTEL_TRACES_SAMPLER="traceidratio",
                  OTEL_TRACES_SAMPLER_ARG="0.25")
provider = tracing.setup_tracing("pagedserve-x")
assert trace.get_tracer_provider() is provider
print(provider.resource.attributes["service.name"], provider.sampler.rate)
os.environ["OTEL_SERVICE_NAME"] = "from-env"
print(tracing.setup_tracing("pagedserve-x").resource.attributes["service.name"])
"""


def test_setup_from_the_environment():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [sys.executable, "-c", _SETUP_SCRIPT],
        cwd=Path(__file__).resolve().parents[3],
        env={**env, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["pagedserve-x", "0.25", "from-env"]


def test_vllm_protocol_call_joins_the_callers_trace(stack, exporter):
    """A gateway's traceparent (metadata) continues through vLLM's engine protocol: the
    RPC span is its child, and the engine's `llm_request` span the RPC span's child."""
    from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

    traceparent, trace_id, parent_span_id = _new_traceparent()
    stub = vllm_engine_pb2_grpc.VllmEngineStub(stack.engine_channel)
    req = vllm_engine_pb2.GenerateRequest(
        request_id="traced-vllm",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=PROMPT),
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=3),
    )
    list(stub.Generate(req, metadata=[("traceparent", traceparent)], timeout=60))
    spans = _spans_of(exporter, int(trace_id, 16), expected=2)
    rpc = spans[("vllm.grpc.engine.VllmEngine/Generate", SpanKind.SERVER)]
    llm_request = spans[("llm_request", SpanKind.SERVER)]
    assert format(rpc.parent.span_id, "016x") == parent_span_id
    assert llm_request.parent.span_id == rpc.context.span_id


def test_load_polls_leave_no_traces(stack, exporter):
    """The tokenizer service polls its engine's Health every 0.2 s here; those calls carry a
    not-sampled context, so they record nothing (they would flood a trace store)."""
    stack.wait_until_idle()
    replica = stack.tokenizer_server.backend.replicas[f"127.0.0.1:{stack.engine_port}"]
    polls = stack.engine_server.metrics.rpc_requests.labels("Health", "OK")
    before = polls._value.get()
    wait_for(lambda: polls._value.get() >= before + 3)
    assert replica.available
    names = {s.name for s in exporter.get_finished_spans()}
    assert "pagedserve.v1.EngineService/Health" not in names
