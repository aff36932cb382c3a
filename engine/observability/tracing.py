"""OpenTelemetry for the engine: one `llm_request` span per request.

The caller's W3C trace context arrives as `trace_headers` (`traceparent`, `tracestate`) on
`add_request`; the span is recorded when the request finishes, as a child of that context,
starting at the request's arrival time. Attributes follow the OpenTelemetry GenAI semantic
conventions (`gen_ai.*`), plus latency attributes for each phase; events mark first
scheduling, the first token, each preemption and the finish.

Without a configured tracer provider (nothing set up, no `otlp_traces_endpoint`) spans are
non-recording and cost next to nothing; requests without trace headers are then skipped
entirely.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.api.span_attributes import SpanAttributes

logger = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")


def contains_trace_headers(headers: Mapping[str, str] | None) -> bool:
    return bool(headers) and any(h in headers for h in TRACE_HEADERS)  # type: ignore[operator]


def extract_trace_context(headers: Mapping[str, str] | None) -> Any | None:
    """The OpenTelemetry context carried by W3C headers, or None."""
    if not contains_trace_headers(headers):
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {k: v for k, v in headers.items() if k in TRACE_HEADERS}  # type: ignore[union-attr]
    return TraceContextTextMapPropagator().extract(carrier)


def init_tracer_provider(otlp_traces_endpoint: str, service_name: str) -> None:
    """Installs a global SDK tracer provider exporting to an OTLP endpoint (vLLM's
    `otlp_traces_endpoint`). `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf` picks HTTP."""
    import os

    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_traces_endpoint)))
    trace.set_tracer_provider(provider)


def tracing_is_configured() -> bool:
    """True when a real (SDK) tracer provider is installed globally."""
    try:
        from opentelemetry import trace
    except ImportError:  # pragma: no cover - a hard dependency
        return False
    provider = trace.get_tracer_provider()
    return type(provider).__module__.startswith("opentelemetry.sdk")


@dataclass
class TraceInfo:
    """What the span needs that the final output does not carry."""

    trace_headers: Mapping[str, str] | None
    params: Any  # SamplingParams or PoolingParams
    preemption_times: list[float]
    lora_name: str | None = None
    fairness_key: str = ""  # "" = the default key


class RequestTracer:
    """Records `llm_request` spans for finished requests."""

    def __init__(self, model_name: str) -> None:
        from opentelemetry import trace

        self.model_name = model_name
        self._tracer = trace.get_tracer("pagedserve.engine")

    def record(self, output: Any, info: TraceInfo, num_output_tokens: int) -> None:
        """`output` is the request's final RequestOutput or PoolingRequestOutput."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        metrics = output.metrics
        if metrics is None:
            return
        context = extract_trace_context(info.trace_headers)
        span = self._tracer.start_span(
            "llm_request",
            context=context,
            kind=SpanKind.SERVER,
            start_time=_ns(metrics.arrival_time),
        )
        completions = getattr(output, "outputs", None)
        finish_reasons = (
            [c.finish_reason or "" for c in completions]
            if isinstance(completions, list)
            else ["stop"]
        )
        span.set_attributes(self._attributes(output, info, metrics, num_output_tokens))
        span.set_attribute(SpanAttributes.FINISH_REASONS, finish_reasons)
        if info.lora_name:
            span.set_attribute(SpanAttributes.LORA_NAME, info.lora_name)
        if info.fairness_key:
            span.set_attribute(SpanAttributes.FAIRNESS_KEY, info.fairness_key)
        if metrics.first_scheduled_time is not None:
            span.add_event("first_scheduled", timestamp=_ns(metrics.first_scheduled_time))
        if metrics.first_token_time is not None:
            span.add_event("first_token", timestamp=_ns(metrics.first_token_time))
        for when in info.preemption_times:
            span.add_event("preempted", timestamp=_ns(when))
        end = metrics.finished_time or metrics.last_token_time
        span.add_event("finished", {"finish_reasons": finish_reasons}, timestamp=_ns(end))
        if "abort" in finish_reasons:
            span.set_status(Status(StatusCode.ERROR, "request aborted"))
        span.end(end_time=_ns(end))

    def _attributes(self, output, info, metrics, num_output_tokens: int) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            SpanAttributes.REQUEST_ID: output.request_id,
            SpanAttributes.REQUEST_MODEL: self.model_name,
            SpanAttributes.RESPONSE_MODEL: self.model_name,
            SpanAttributes.SYSTEM: "pagedserve",
            SpanAttributes.INPUT_TOKENS: len(output.prompt_token_ids),
            SpanAttributes.OUTPUT_TOKENS: num_output_tokens,
            SpanAttributes.CACHED_INPUT_TOKENS: output.num_cached_tokens or 0,
            SpanAttributes.NUM_PREEMPTIONS: metrics.num_preemptions,
        }
        params = info.params
        if hasattr(params, "temperature"):
            attrs[SpanAttributes.OPERATION] = "text_completion"
            attrs[SpanAttributes.TEMPERATURE] = params.temperature
            attrs[SpanAttributes.TOP_P] = params.top_p
            attrs[SpanAttributes.TOP_K] = params.top_k
            attrs[SpanAttributes.N] = params.n
            if params.max_tokens is not None:
                attrs[SpanAttributes.MAX_TOKENS] = params.max_tokens
            if params.seed is not None:
                attrs[SpanAttributes.SEED] = params.seed
        else:
            attrs[SpanAttributes.OPERATION] = "embeddings"
        arrival, scheduled = metrics.arrival_time, metrics.first_scheduled_time
        first_token, finished = metrics.first_token_time, metrics.finished_time
        if scheduled is not None:
            attrs[SpanAttributes.TIME_IN_QUEUE] = scheduled - arrival
        if first_token is not None:
            attrs[SpanAttributes.TIME_TO_FIRST_TOKEN] = first_token - arrival
            if scheduled is not None:
                attrs[SpanAttributes.TIME_IN_PREFILL] = first_token - scheduled
            if finished is not None:
                attrs[SpanAttributes.TIME_IN_DECODE] = finished - first_token
        if finished is not None:
            attrs[SpanAttributes.E2E] = finished - arrival
        return attrs


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
