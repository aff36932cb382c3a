"""`LLMEngine`: vLLM's synchronous engine API over our scheduler and model runner.

step():
    scheduler_output = scheduler.schedule()
    executor.submit(scheduler_output)        # the model runner, here or in rank processes
    runner_output    = executor.collect()
    updated          = scheduler.update(scheduler_output, runner_output)
    outputs          = output_processor.process(updated, runner_output)

With pipeline parallelism up to `pipeline_parallel_size` steps are submitted before the
oldest is collected, so the stages work on different batches at once (vLLM's virtual
engines); a request is in at most one of them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineArgs,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.sched_output import SchedulerOutput
from engine.core.scheduler import Scheduler
from engine.executor import create_executor
from engine.input_processor import InputProcessor, PromptType
from engine.lora.request import LoRARequest
from engine.metrics import EngineMetrics
from engine.output_processor import OutputProcessor
from engine.outputs import PoolingRequestOutput, RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.stats import StatLogger, StepStats
from engine.stop_tokenizer import StopStringTokenizer
from engine.structured_output.config import DecodingConfig
from engine.structured_output.manager import StructuredOutputManager
from engine.tracing import (
    RequestTracer,
    TraceInfo,
    contains_trace_headers,
    init_tracer_provider,
    tracing_is_configured,
)

if TYPE_CHECKING:
    from engine.lora.manager import LoRAManager
    from engine.lora.metrics import LoRAInfoGauge

logger = logging.getLogger(__name__)


@dataclass
class _LiveRequest:
    params: SamplingParams | PoolingParams
    trace_headers: Mapping[str, str] | None
    samples: list[Request]
    traced: bool
    lora_name: str | None = None


_SEED_MASK = (1 << 63) - 1
_STATS_INTERVAL_S = 10.0
_IDLE_WAIT_S = 0.01


class LLMEngine:
    def __init__(self, config: EngineConfig, log_stats: bool = False) -> None:
        from engine.lora.manager import LoRAManager
        from engine.lora.metrics import LoRAInfoGauge
        from engine.models.loader import load_tokenizer
        from engine.models.registry import get_model_class

        model_config = config.model_config
        self.tokenizer = None
        if not model_config.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(model_config.tokenizer_dir or model_config.model_dir)
        self._failure_listeners: list[Callable[[], None]] = []
        self.executor = create_executor(config, on_failure=self._on_executor_failure)
        self.runner = self.executor.runner  # None when the model lives in rank processes
        self._in_flight: deque[SchedulerOutput] = deque()  # submitted, not collected
        self.lora_manager: LoRAManager | None = None
        if config.lora_config is not None:
            self._require_runner("LoRA adapters")
            self.lora_manager = LoRAManager(
                config.lora_config, model_config.hf_config, self.runner.dtype, self.runner.device
            )
            self.lora_manager.attach(self.runner.model)
            self.runner.lora_manager = self.lora_manager
        # The KV-cache size is decided once, by the runner from the memory budget, and
        # handed on as a value; the engine's config is a resolved copy that records it (the
        # caller's config object is not written to).
        num_blocks = self.executor.num_blocks
        cache = replace(config.cache_config, num_blocks=num_blocks)
        self.config = config = replace(config, cache_config=cache)
        hf_config = model_config.hf_config
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            sliding_window=get_model_class(hf_config).kv_cache_sliding_window(hf_config),
        )
        # A sequence can never outgrow the whole cache: that is its length limit too.
        self.max_tokens_in_cache = num_blocks * cache.block_size
        if self.max_tokens_in_cache < model_config.max_model_len:
            logger.warning(
                "The KV cache holds %d tokens, fewer than max_model_len=%d: longer "
                "sequences finish with reason 'length' at %d tokens.",
                self.max_tokens_in_cache,
                model_config.max_model_len,
                self.max_tokens_in_cache,
            )
        sched_config = config.scheduler_config
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=sched_config.max_num_seqs,
                max_num_batched_tokens=sched_config.max_num_batched_tokens,
                max_model_len=min(sched_config.max_model_len, self.max_tokens_in_cache),
                enable_chunked_prefill=sched_config.enable_chunked_prefill,
                policy=sched_config.policy,
                max_loras=config.lora_config.max_loras if config.lora_config else None,
            ),
            self.kv_cache_manager,
            config.speculative_config,
        )
        self._last_logged_drafts = (0, 0)  # (scheduled, accepted) at the last stats line
        stop_tokenizer = StopStringTokenizer(
            self.tokenizer, model_config.tokenizer_dir or model_config.model_dir
        )
        self.output_processor = OutputProcessor(self.tokenizer, stop_tokenizer)
        self.input_processor = InputProcessor(
            config, num_blocks, self.get_tokenizer, stop_tokenizer
        )
        self.log_stats = log_stats
        self.stat_logger = StatLogger()
        self._seed_rng = random.Random(model_config.seed)
        self._pending_outputs: list[RequestOutput | PoolingRequestOutput] = []
        self._salt_counter = 0
        if config.otlp_traces_endpoint:
            service = os.environ.get("OTEL_SERVICE_NAME", "pagedserve-engine")
            init_tracer_provider(config.otlp_traces_endpoint, service)
        self.tracing_enabled = tracing_is_configured()
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
        self.structured_output_manager = StructuredOutputManager(model_config)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config(), log_stats=not engine_args.disable_log_stats)

    # ---- config getters -----------------------------------------------------------------

    def get_model_config(self) -> ModelConfig:
        return self.config.model_config

    def get_cache_config(self) -> CacheConfig:
        return self.config.cache_config

    def get_scheduler_config(self) -> SchedulerConfig:
        return self.config.scheduler_config

    def get_device_config(self) -> DeviceConfig:
        return self.config.device_config

    def get_engine_config(self) -> EngineConfig:
        return self.config

    def get_decoding_config(self) -> DecodingConfig:
        """Which grammar backend enforces structured outputs."""
        return self.structured_output_manager.decoding_config

    def get_parallel_config(self) -> ParallelConfig:
        return self.config.parallel_config

    # ---- the executor -------------------------------------------------------------------

    def _require_runner(self, feature: str) -> Any:
        """The in-process model runner, which `feature` needs."""
        if self.runner is None:
            raise ValueError(
                f"{feature}: needs the model in the engine's process, not supported with "
                "distributed_executor_backend='mp' (tensor_parallel_size="
                f"{self.config.parallel_config.tensor_parallel_size}, pipeline_parallel_size="
                f"{self.config.parallel_config.pipeline_parallel_size})."
            )
        return self.runner

    def add_failure_listener(self, listener: Callable[[], None]) -> None:
        """`listener` runs (on another thread) when a rank fails; the next `step()` then
        raises. The engine thread uses this to wake up and die while idle."""
        self._failure_listeners.append(listener)

    def _on_executor_failure(self) -> None:
        for listener in list(self._failure_listeners):
            listener()

    def check_health(self) -> None:
        """Raises if a rank of a multi-process engine died or stopped answering."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stops the rank processes of a multi-process engine (idempotent)."""
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()

    def get_lora_config(self) -> LoRAConfig | None:
        """None without `enable_lora` (as vLLM)."""
        return self.config.lora_config

    def get_input_preprocessor(self) -> InputProcessor:
        """What turns a prompt (text or token ids) into checked token ids."""
        return self.input_processor

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("The tokenizer was not initialised (skip_tokenizer_init=True).")
        return self.tokenizer

    # ---- requests -----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora_request: Any = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
    ) -> None:
        """Queues a request. `prompt` is text or ``{"prompt_token_ids": [...]}``.

        With `PoolingParams` it is a pooling request: its one output is a
        `PoolingRequestOutput` holding the prompt's final hidden states pooled as the
        engine's `PoolerConfig` says (LAST, MEAN or CLS)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}.")
        if lora_request is not None:
            self._require_lora().add_lora(lora_request)  # loads and checks it if new
        if not isinstance(params, SamplingParams | PoolingParams):
            raise TypeError(
                f"params must be SamplingParams or PoolingParams, got {type(params).__name__}."
            )
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {priority!r}.")
        if priority != 0 and self.config.scheduler_config.policy != "priority":
            raise ValueError(
                f"priority={priority} needs scheduling_policy='priority' "
                f"(the engine uses {self.config.scheduler_config.policy!r})."
            )
        if self.output_processor.has_request(request_id) or request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request.")
        text, prompt_token_ids = self.input_processor.process(prompt, params)
        if isinstance(params, PoolingParams):  # the engine's copy, checked and completed
            params = params.clone()
            params.verify(self.config.pooler_config, self.config.model_config)

        # vLLM's `cache_salt` in the prompt dict: prompts with different salts never share
        # prefix-cache blocks (the services salt by tenant).
        salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
        if salt is not None and not isinstance(salt, str):
            raise TypeError(f"cache_salt must be a str, got {type(salt).__name__}.")
        salt = salt or None  # "" is no salt
        if not self.config.cache_config.enable_prefix_caching:
            # Without prefix caching only the n samples of this prompt share blocks.
            self._salt_counter += 1
            salt = f"{salt or ''}/{request_id}/{self._salt_counter}"
        arrival = arrival_time if arrival_time is not None else time.time()
        headers = dict(trace_headers) if trace_headers else None
        if isinstance(params, PoolingParams):
            pooling = Request(
                request_id,
                prompt_token_ids,
                None,
                arrival_time=arrival,
                priority=priority,
                cache_salt=salt,
                trace_headers=headers,
                pooling_params=params,
                lora_request=lora_request,
            )
            self.output_processor.add_pooling_request(text, pooling)
            self.scheduler.add_request(pooling)
            self._track(request_id, headers, params, [pooling])
            return
        params = params.clone()
        params.update_from_generation_config(self.config.model_config.eos_token_ids)
        self.input_processor.process_token_controls(params)
        if params.structured_outputs is not None:
            self.structured_output_manager.validate(params.structured_outputs)
        samples = []
        for index in range(params.n):
            seed = (
                (params.seed + index) & _SEED_MASK
                if params.seed is not None
                else self._seed_rng.getrandbits(63)
            )
            samples.append(
                Request(
                    request_id if params.n == 1 else f"{request_id}#{index}",
                    prompt_token_ids,
                    params,
                    arrival_time=arrival,
                    priority=priority,
                    seed=seed,
                    cache_salt=salt,
                    parent_id=request_id,
                    index=index,
                    trace_headers=headers,
                    lora_request=lora_request,
                )
            )
        if any(s.request_id in self.scheduler.requests for s in samples):
            raise ValueError(f"request_id {request_id!r} collides with a live request's sample.")
        self.output_processor.add_request(request_id, text, prompt_token_ids, params, samples)
        for sample in samples:
            if params.structured_outputs is not None:
                self.structured_output_manager.add_request(sample)
            self.scheduler.add_request(sample)
        self._track(request_id, headers, params, samples)

    def _track(self, request_id, headers, params, samples: list[Request]) -> None:
        """Remembers what the request's metrics and span need once it finishes. A span is
        recorded when the caller sent trace context or a tracer provider is configured."""
        traced = contains_trace_headers(headers) or self.tracing_enabled
        lora = samples[0].lora_request
        lora_name = lora.lora_name if lora is not None else None
        self._live[request_id] = _LiveRequest(params, headers, samples, traced, lora_name)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Aborts requests (unknown or finished ids are ignored); frees their blocks now.

        The next `step()` returns a final output with finish_reason "abort" for each."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if not self.output_processor.has_request(rid):
                continue
            sample_ids = self.output_processor.sample_ids(rid)
            self.scheduler.finish_requests(sample_ids, RequestStatus.FINISHED_ABORTED)
            final = self.output_processor.abort_request(rid)
            if final is not None:
                self._pending_outputs.append(final)
            else:  # an aborted pooling request ends without an output
                self._live.pop(rid, None)
        self._update_gauges()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_unfinished_requests_for_virtual_engine(self, virtual_engine: int) -> bool:
        """vLLM's virtual engines are the batch slots of a pipeline: up to
        `pipeline_parallel_size` batches in flight. Slot i (the i-th oldest batch in
        flight) has unfinished requests when its batch holds an unfinished one; a free slot
        has them when unfinished requests wait for the next batch (not in flight)."""
        num_virtual = self.config.parallel_config.pipeline_parallel_size
        if not isinstance(virtual_engine, int) or not 0 <= virtual_engine < num_virtual:
            raise ValueError(
                f"virtual_engine must be in [0, {num_virtual}) (pipeline_parallel_size="
                f"{num_virtual}), got {virtual_engine!r}."
            )
        if virtual_engine < len(self._in_flight):
            batch = self._in_flight[virtual_engine]
            return any(not e.request.is_finished() for e in batch.scheduled)
        in_flight = {e.request_id for b in self._in_flight for e in b.scheduled}
        return any(r not in in_flight for r in self.scheduler.requests)

    # ---- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        self.executor.check_health()
        self._abort_failed_grammars()
        outputs, self._pending_outputs = self._pending_outputs, []
        # Asleep, nothing is scheduled: requests wait for wake_up() (aborts still end).
        if not self.is_sleeping():
            self._submit_steps()
        if self._in_flight:
            scheduler_output = self._in_flight.popleft()
            runner_output = self.executor.collect()
            updated = self.scheduler.update(scheduler_output, runner_output)
            step_outputs, stopped = self.output_processor.process(updated, runner_output)
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
            outputs.extend(step_outputs)
            self._record_stats(scheduler_output, runner_output)
        self._finish_outputs(outputs)
        self._update_gauges()
        return outputs

    def _batch_cap(self) -> int | None:
        """With several batches in flight, each takes at most its share of the live
        requests, so every stage of the pipeline has a batch to work on."""
        num_batches = self.executor.max_concurrent_batches
        if num_batches == 1:
            return None
        num_live = len(self.scheduler.running) + len(self.scheduler.waiting)
        return max(1, -(-num_live // num_batches))

    def _submit_steps(self) -> None:
        """Schedules and submits steps until the executor has as many in flight as it
        takes (one without pipeline parallelism) or nothing more can be scheduled."""
        while (
            len(self._in_flight) < self.executor.max_concurrent_batches
            and self.scheduler.has_unfinished_requests()
        ):
            scheduler_output = self.scheduler.schedule(self._batch_cap())
            if scheduler_output.is_empty:
                self.executor.skip(scheduler_output)
                if not self._in_flight:
                    # Only requests whose grammar is compiling: wait rather than spin.
                    self.structured_output_manager.wait_for_compilation(_IDLE_WAIT_S)
                return
            self.executor.submit(scheduler_output)
            self._in_flight.append(scheduler_output)

    def _update_gauges(self) -> None:
        """The gauges routers read (waiting, running, KV usage), after every step and
        every abort, so they are right even when an abort leaves nothing to step."""
        m = self.metrics
        m.num_requests_running.set(len(self.scheduler.running))
        m.num_requests_waiting.set(len(self.scheduler.waiting))
        m.kv_cache_usage.set(self.kv_cache_manager.usage)

    def _abort_failed_grammars(self) -> None:
        """A grammar that passed the check at add_request but failed to compile (rare: the
        vocabulary-level step refused it) aborts its request; the reason is logged."""
        for sample_id in self.structured_output_manager.take_failed():
            request = self.scheduler.requests.get(sample_id)
            if request is not None:
                self.abort_request(request.parent_id)

    def _finish_outputs(self, outputs: list[RequestOutput | PoolingRequestOutput]) -> None:
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
                    TraceInfo(live.trace_headers, live.params, preemptions, live.lora_name),
                    num_generated,
                )

    def _record_stats(self, scheduler_output, runner_output) -> None:
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
        if self.lora_info is not None:
            self.lora_info.update(self.scheduler.running, self.scheduler.waiting)
        if self.log_stats and time.monotonic() - self.stat_logger.last_log_time > _STATS_INTERVAL_S:
            self.do_log_stats()

    def do_log_stats(self) -> str:
        """Logs (and returns) one line: requests, KV-cache use, throughput, prefix hits; with
        speculative decoding, a second line with the draft acceptance rate since the last."""
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

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # ---- LoRA adapters ------------------------------------------------------------------

    def _require_lora(self) -> LoRAManager:
        if self.lora_manager is None:
            raise ValueError("LoRA adapters need enable_lora=True in the engine arguments.")
        return self.lora_manager

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads and checks an adapter (a ValueError says what is wrong with a bad one);
        False if its id is loaded already."""
        return self._require_lora().add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._require_lora().remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self._require_lora().list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        """Keeps the adapter loaded whatever max_cpu_loras' LRU would evict."""
        return self._require_lora().pin_lora(lora_id)

    # ---- sleep mode ---------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Frees the KV cache (level 1; on CUDA the weights move to host memory) or the KV
        cache and the weights (level 2), see `worker/sleep.py`. The engine must be idle;
        requests added while it sleeps wait for `wake_up()`."""
        self._require_runner("sleep mode")
        num_unfinished = self.get_num_unfinished_requests()
        if num_unfinished:
            raise RuntimeError(
                f"sleep() needs an idle engine: {num_unfinished} requests are unfinished "
                "(finish or abort them first)."
            )
        if not self.runner.sleep_mode.is_sleeping:
            # The cached blocks' contents go with the cache.
            assert self.kv_cache_manager.reset_prefix_cache(), "an idle engine holds blocks"
        self.runner.sleep_mode.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restores the parts in `tags` ("weights", "kv_cache"; None: all). Steps resume
        once every part is back."""
        self._require_runner("sleep mode").sleep_mode.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.runner is not None and self.runner.sleep_mode.is_sleeping

    # ---- profiling ----------------------------------------------------------------------

    def start_profile(self) -> None:
        """Starts a torch.profiler session over the following steps; the trace directory is
        `PAGEDSERVE_TORCH_PROFILER_DIR` (a ValueError naming it when unset)."""
        runner = self._require_runner("profiling")
        runner.profiler.start(runner.model)

    def stop_profile(self) -> Path:
        """Ends the session and writes its Chrome trace; returns the trace file's path."""
        return self._require_runner("profiling").profiler.stop()
