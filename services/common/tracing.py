"""OpenTelemetry in the services: one trace from the client, through both services, to the
engine's `llm_request` span.

    client span ── traceparent in metadata and/or GenerateRequest.trace_headers
    └─ pagedserve.v1.TextGenerationService/Generate   SERVER    tokenizer service
       ├─ tokenize                                     INTERNAL  chat template, tokenizer
       ├─ pagedserve.v1.EngineService/Generate         CLIENT    the call to the engine
       │  └─ pagedserve.v1.EngineService/Generate      SERVER    engine service
       │     └─ llm_request                                      engine/observability/tracing.py
       └─ detokenize                                   INTERNAL  relaying the stream as text

The caller's context comes as W3C `traceparent` / `tracestate`, in the gRPC metadata or in
the request's `trace_headers` map (the metadata wins). Each hop passes its own span on as
the parent, in both places. Every RPC of both services gets a SERVER span (`rpc_method` in
`services/common/errors.py` opens it); its status is the call's status code.

Tracing is set up per process from the standard `OTEL_*` variables (`setup_tracing`). When
they do not ask for it, no provider is installed: spans are non-recording, cost next to
nothing, and the caller's context is forwarded unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.api.span_attributes import SpanAttributes
from services.common.grpc_server import trace_headers
from services.security.caller import current_tenant_name

logger = logging.getLogger("services.common.tracing")

TOKENIZER_SERVICE_NAME = "pagedserve-tokenizer"
ENGINE_SERVICE_NAME = "pagedserve-engine"
GRPC_STATUS_CODE = "rpc.grpc.status_code"
TENANT_ATTRIBUTE = "pagedserve.tenant"  # the caller's tenant (API keys on), never its key

# A proxy until a provider is installed (then it delegates), so importing this module early
# is fine.
_TRACER = trace.get_tracer("pagedserve.services")
_PROPAGATOR = TraceContextTextMapPropagator()


# ---- set-up -------------------------------------------------------------------------------


def tracing_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard variables ask for spans: `OTEL_TRACES_EXPORTER` (anything but
    `none`), else an OTLP endpoint (`OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def setup_tracing(default_service_name: str) -> Any | None:
    """Installs the process's tracer provider when `tracing_requested()`; returns it (call
    its `shutdown()` before exiting, to flush), or None when tracing stays off.

    Everything else comes from the SDK's own variables: `OTEL_SERVICE_NAME` and
    `OTEL_RESOURCE_ATTRIBUTES` (the service name defaults to `default_service_name`),
    `OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT / PROTOCOL / HEADERS`
    and `OTEL_BSP_*`."""
    if not tracing_requested():
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()  # reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    names = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower().split(",")
    for name in filter(None, (n.strip() for n in names)):
        exporter = _exporter(name)
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    logger.info(
        "tracing on",
        extra={
            "service_name": resource.attributes.get(SERVICE_NAME),
            "exporters": ",".join(names),
            "protocol": _otlp_protocol(),
        },
    )
    return provider


def _otlp_protocol() -> str:
    return (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()


def _exporter(name: str) -> Any | None:
    """The exporter `OTEL_TRACES_EXPORTER` names; the OTLP ones read their endpoint,
    headers and timeout from the environment themselves."""
    if name == "otlp":
        if _otlp_protocol().startswith("http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[assignment]
                OTLPSpanExporter,
            )
        return OTLPSpanExporter()
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    logger.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none)", name)
    return None


# ---- spans --------------------------------------------------------------------------------


@contextlib.contextmanager
def rpc_span(name: str, request: Any, context: grpc.aio.ServicerContext) -> Iterator[Span]:
    """The SERVER span of one RPC, current inside the block: a child of the caller's
    context (metadata, else the request's `trace_headers`), or the root of a new trace.
    The caller sets its status (`end_rpc_span`)."""
    headers = trace_headers(getattr(request, "trace_headers", {}), context)
    service, _, method = name.rpartition("/")
    with _TRACER.start_as_current_span(
        name,
        context=_PROPAGATOR.extract(headers),  # an empty context: a new trace
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        tenant = current_tenant_name()  # set by the API-key guard; never the key
        if tenant is not None:
            span.set_attribute(TENANT_ATTRIBUTE, tenant)
        yield span


def end_rpc_span(span: Span, code: grpc.StatusCode, message: str) -> None:
    span.set_attribute(GRPC_STATUS_CODE, code.value[0])
    if code != grpc.StatusCode.OK:
        set_error(span, code, message)


def set_error(span: Span, code: grpc.StatusCode, message: str) -> None:
    if code == grpc.StatusCode.CANCELLED:
        span.add_event("cancelled", {"message": message})
    span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"))


@contextlib.contextmanager
def internal_span(name: str) -> Iterator[Span]:
    """A child of the current span, current inside the block."""
    with _TRACER.start_as_current_span(name, record_exception=False) as span:
        yield span


def start_client_span(name: str) -> Span:
    """A CLIENT span for an outgoing call, child of the current span (not made current:
    pass it to `outgoing_trace_headers`, and end it)."""
    return _TRACER.start_span(
        name, kind=SpanKind.CLIENT, record_exception=False, set_status_on_exception=False
    )


def outgoing_trace_headers(incoming: Mapping[str, str], parent: Span | None = None) -> dict:
    """The trace headers for the next hop: `incoming` with its W3C context replaced by
    `parent`'s (default: the current span). With tracing off the spans are non-recording
    copies of the caller's context, so the incoming context passes through unchanged."""
    headers = dict(incoming)
    carrier: dict[str, str] = {}
    context = trace.set_span_in_context(parent) if parent is not None else None
    _PROPAGATOR.inject(carrier, context=context)
    if carrier:  # a valid span: it is the parent now (and its tracestate, if any, goes too)
        headers.pop("tracestate", None)
        headers.update(carrier)
    return headers


# ---- GenAI attributes ---------------------------------------------------------------------


def set_request_attributes(span: Span, request_id: str, model: str, params: Any) -> None:
    """`gen_ai.request.*` of a generate request, its parameters after defaults: an
    `engine.SamplingParams` (engine service) or a `RequestSampling` (tokenizer service)."""
    if not span.is_recording():
        return
    attributes: dict[str, Any] = {
        SpanAttributes.REQUEST_ID: request_id,
        SpanAttributes.REQUEST_MODEL: model,
        SpanAttributes.OPERATION: "text_completion",
        SpanAttributes.SYSTEM: "pagedserve",
        SpanAttributes.TEMPERATURE: params.temperature,
        SpanAttributes.TOP_P: params.top_p,
        SpanAttributes.TOP_K: params.top_k,
        SpanAttributes.N: params.n,
    }
    if params.max_tokens is not None:
        attributes[SpanAttributes.MAX_TOKENS] = params.max_tokens
    if params.seed is not None:
        attributes[SpanAttributes.SEED] = params.seed
    span.set_attributes(attributes)


def set_usage_attributes(
    span: Span, num_input_tokens: int, num_output_tokens: int, finish_reasons: list[str]
) -> None:
    """`gen_ai.usage.*` and `gen_ai.response.finish_reasons` (one per output index); an
    aborted output makes the span an error, as the engine's `llm_request`."""
    if not span.is_recording():
        return
    span.set_attributes(
        {
            SpanAttributes.INPUT_TOKENS: num_input_tokens,
            SpanAttributes.OUTPUT_TOKENS: num_output_tokens,
            SpanAttributes.FINISH_REASONS: finish_reasons,
        }
    )
    if "abort" in finish_reasons:
        span.add_event("aborted")
        span.set_status(Status(StatusCode.ERROR, "request aborted"))


def set_abort_attributes(span: Span, request_ids: Iterable[str]) -> None:
    if span.is_recording():
        span.set_attribute("pagedserve.abort.request_ids", list(request_ids))
