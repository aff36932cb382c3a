"""What `LLMEngine` records about its work: Prometheus metrics, the periodic stats line and
each request's `llm_request` span.

The engine calls `EngineRecorder` at fixed points: `track` when a request is added,
`record_step` after each collected step, `record_finished` for the outputs a step returns,
`update_gauges` after every step and abort. It reads the scheduler and the KV-cache manager
it is given and writes nothing back.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.api.outputs import PoolingRequestOutput, RequestOutput
from engine.api.sampling_params import SamplingParams
from engine.config.resolved import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.sched_output import SchedulerOutput
from engine.core.scheduler import Scheduler
from engine.lora.metrics import LoRAInfoGauge
from engine.observability.metrics import EngineMetrics
from engine.observability.stats import StatLogger, StepStats
from engine.observability.tracing import (
    RequestTracer,
    TraceInfo,
    contains_trace_headers,
    init_tracer_provider,
    tracing_is_configured,
)
from engine.pooling_params import PoolingParams

if TYPE_CHECKING:
    from engine.lora.metrics import LoRAInfoGauge

# The speculative-decoding line is logged under LLMEngine's logger name (log configurations
# filter by it).
logger = logging.getLogger("engine.front.llm_engine")

_STATS_INTERVAL_S = 10.0


@dataclass
class _LiveRequest:
    params: SamplingParams | PoolingParams
    trace_headers: Mapping[str, str] | None
    samples: list[Request]
    traced: bool
    lora_name: str | None = None
    fairness_key: str = ""


class EngineRecorder:
    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        kv_cache_manager: KVCacheManager,
        log_stats: bool,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.kv_cache_manager = kv_cache_manager
        self._last_logged_drafts = (0, 0)  # (scheduled, accepted) at the last stats line
        self.log_stats = log_stats
        self.stat_logger = StatLogger()
        if config.otlp_traces_endpoint:
            service = os.environ.get("OTEL_SERVICE_NAME", "pagedserve-engine")
            init_tracer_provider(config.otlp_traces_endpoint, service)
        self.tracing_enabled = tracing_is_configured()
        model_config = config.model_config
        self.request_tracer = RequestTracer(model_config.served_model_name)
        self.metrics = EngineMetrics(model_config.served_model_name)
        self.metrics.set_cache_config_info(
            config.cache_config.block_size, self.kv_cache_manager.num_blocks
        )
        self.lora_info: LoRAInfoGauge | None = None
        if config.lora_config is not None:
            self.lora_info = LoRAInfoGauge(self.metrics.registry, config.lora_config.max_loras)
            self.lora_info.update([], [])
        self._live: dict[str, _LiveRequest] = {}  # until the final output is returned

    def track(
        self,
        request_id: str,
        headers: dict[str, str] | None,
        params: SamplingParams | PoolingParams,
        samples: list[Request],
    ) -> None:
        """Remembers what the request's metrics and span need once it finishes. A span is
        recorded when the caller sent trace context or a tracer provider is configured."""
        traced = contains_trace_headers(headers) or self.tracing_enabled
        lora = samples[0].lora_request
        lora_name = lora.lora_name if lora is not None else None
        self._live[request_id] = _LiveRequest(
            params, headers, samples, traced, lora_name, samples[0].fairness_key
        )

    def untrack(self, request_id: str) -> None:
        """Forgets a request that ends without an output (an aborted pooling request)."""
        self._live.pop(request_id, None)

    def update_gauges(self) -> None:
        """The gauges routers read (waiting, running, KV usage), after every step and
        every abort, so they are right even when an abort leaves nothing to step."""
        m = self.metrics
        m.num_requests_running.set(len(self.scheduler.running))
        m.num_requests_waiting.set(len(self.scheduler.waiting))
        m.kv_cache_usage.set(self.kv_cache_manager.usage)

    def record_finished(self, outputs: list[RequestOutput | PoolingRequestOutput]) -> None:
        """Metrics and the `llm_request` span of each request that finished this step."""
        for output in outputs:
            live = self._live.pop(output.request_id, None) if output.finished else None
            if live is None or output.metrics is None:
                continue
            num_generated = sum(r.num_output_tokens for r in live.samples)
            m = output.metrics
            completions = output.outputs if isinstance(output, RequestOutput) else []
            self.metrics.record_finished(
                [c.finish_reason or "stop" for c in completions] or ["stop"],
                len(output.prompt_token_ids),
                num_generated,
                m.arrival_time,
                m.first_scheduled_time,
                m.first_token_time,
                m.finished_time,
            )
            if live.traced:
                preemptions = sorted(t for r in live.samples for t in r.times.preemption_times)
                self.request_tracer.record(
                    output,
                    TraceInfo(
                        live.trace_headers,
                        live.params,
                        preemptions,
                        live.lora_name,
                        live.fairness_key,
                    ),
                    num_generated,
                )

    def record_step(self, scheduler_output: SchedulerOutput) -> None:
        """The counts of one collected step; the stats line every _STATS_INTERVAL_S when
        log_stats is on."""
        num_prompt = sum(
            e.num_new_tokens
            for e in scheduler_output.scheduled
            if e.num_computed_tokens < e.request.num_prompt_tokens
        )
        num_generated = self.scheduler.num_output_tokens_last_update
        self.stat_logger.record_step(StepStats(num_prompt, num_generated))
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        self.stat_logger.record_prefix_cache(prefix.queries, prefix.hits)
        m = self.metrics
        m.num_preemptions.inc(len(scheduler_output.preempted_request_ids))
        m.prefix_cache_queries.inc(prefix.queries)
        m.prefix_cache_hits.inc(prefix.hits)
        m.prompt_tokens.inc(num_prompt)
        m.generation_tokens.inc(num_generated)
        fairness = self.scheduler.fairness
        m.record_tenant_tokens(
            {key: (s.prompt, s.output) for key, s in fairness.drain_served().items()},
            {key: state.counter for key, state in fairness.keys.items()},
        )
        if self.lora_info is not None:
            self.lora_info.update(self.scheduler.running, self.scheduler.waiting)
        if self.log_stats and time.monotonic() - self.stat_logger.last_log_time > _STATS_INTERVAL_S:
            self.do_log_stats()

    def do_log_stats(self) -> str:
        """`LLMEngine.do_log_stats`: the stats line, and the draft acceptance line."""
        line = self.stat_logger.log(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
        )
        if self.config.speculative_config is None:
            return line
        scheduler = self.scheduler
        drafts = (scheduler.num_draft_tokens, scheduler.num_accepted_draft_tokens)
        num_drafts, num_accepted = (
            now - last for now, last in zip(drafts, self._last_logged_drafts)
        )
        self._last_logged_drafts = drafts
        rate = 100.0 * num_accepted / num_drafts if num_drafts else 0.0
        spec_line = (
            f"Speculative decoding: draft acceptance rate: {rate:.1f}%, "
            f"Accepted: {num_accepted} tokens, Drafted: {num_drafts} tokens"
        )
        logger.info(spec_line)
        return f"{line}\n{spec_line}"
