"""`LLMEngine`: vLLM's synchronous engine API over our scheduler and model runner.

step():
    scheduler_output = scheduler.schedule()
    executor.submit(scheduler_output)        # the model runner, here or in rank processes
    runner_output    = executor.collect()
    updated          = scheduler.update(scheduler_output, runner_output)
    outputs          = output_processor.process(updated, runner_output)

With pipeline parallelism up to `pipeline_parallel_size` steps are submitted before the
oldest is collected, so the stages work on different batches at once (vLLM's virtual
engines); a request is in at most one of them. With `async_scheduling` two steps are in
flight on one device: step N+1 is scheduled and submitted before step N is collected, its
decoding requests again, each with one placeholder token (engine/core/async_scheduling.py).

Beside this file: `add_request`'s arguments become one `EngineRequest`
(engine/core/engine_request.py), which request_builder.py turns into `Request`s; the
metrics, stats line and spans are recorded by engine_recorder.py, and the LoRA, sleep-mode
and profiling methods come from llm_engine_admin.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from engine.api.model_files import load_tokenizer
from engine.api.outputs import PoolingRequestOutput, RequestOutput
from engine.api.sampling_params import SamplingParams
from engine.config.engine_config import (
    EngineArgs,
    EngineConfig,
    LoRAConfig,
)
from engine.config.rope import rope_regime
from engine.core import async_scheduling
from engine.core.engine_request import EngineRequest
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import RequestStatus
from engine.core.sched_output import SchedulerOutput
from engine.core.scheduler import Scheduler
from engine.executor.uniproc import create_executor
from engine.front.config_getters import LLMEngineConfigGetters
from engine.front.llm_engine_admin import LLMEngineAdminMixin
from engine.models.registry import get_model_class
from engine.observability.metrics import EngineMetrics
from engine.observability.recorder import EngineRecorder
from engine.observability.stats import StatLogger
from engine.pooling_params import PoolingParams
from engine.processing.input_processor import InputProcessor, PromptType
from engine.processing.output_processor import OutputProcessor
from engine.processing.request_builder import RequestBuilder
from engine.processing.resume import ResumedOutputTokenIds
from engine.processing.stop_tokenizer import StopStringTokenizer
from engine.sample import sampling_slots
from engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.01


class LLMEngine(LLMEngineConfigGetters, LLMEngineAdminMixin):
    def __init__(self, config: EngineConfig, log_stats: bool = False) -> None:
        model_config = config.model_config
        self.tokenizer = None
        if not model_config.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(model_config.tokenizer_dir or model_config.model_dir)
        self._failure_listeners: list[Callable[[], None]] = []
        # The model, its KV cache and its LoRA adapters live behind the executor: steps go
        # through submit/collect, everything else through collective_rpc.
        self.executor = create_executor(config, on_failure=self._on_executor_failure)
        self._in_flight: deque[SchedulerOutput] = deque()  # submitted, not collected
        # Whether the runner counts the penalties' tokens on the device (async scheduling
        # then need not fall back for them).
        self._penalties_on_device = sampling_slots.counts_penalties_on_device(
            config.device_config.device
        )
        self._added_loras: dict[int, Any] = {}  # LoRARequest by id (llm_engine_admin.py)
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
            rope=rope_regime(hf_config),
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
            replace(
                sched_config,
                max_model_len=min(sched_config.max_model_len, self.max_tokens_in_cache),
                max_loras=config.lora_config.max_loras if config.lora_config else None,
            ),
            self.kv_cache_manager,
            config.speculative_config,
        )
        stop_tokenizer = StopStringTokenizer(
            self.tokenizer, model_config.tokenizer_dir or model_config.model_dir
        )
        self.output_processor = OutputProcessor(self.tokenizer, stop_tokenizer)
        self.input_processor = InputProcessor(
            config, num_blocks, self.get_tokenizer, stop_tokenizer
        )
        self._pending_outputs: list[RequestOutput | PoolingRequestOutput] = []
        self._max_in_flight = self._steps_in_flight(config)
        self.recorder = EngineRecorder(config, self.scheduler, self.kv_cache_manager, log_stats)
        self.structured_output_manager = StructuredOutputManager(model_config)
        self.request_builder = RequestBuilder(
            config, self.input_processor, self.structured_output_manager
        )

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config(), log_stats=not engine_args.disable_log_stats)

    @property
    def runner(self) -> Any:
        """The in-process model runner, for tests and benchmarks that look inside (None
        when the model lives in rank processes). The engine itself never reads it."""
        return self.executor.runner

    @property
    def metrics(self) -> EngineMetrics:
        """The engine's Prometheus metrics, in its own registry
        (engine/observability/metrics.py)."""
        return self.recorder.metrics

    @property
    def stat_logger(self) -> StatLogger:
        """The stats line's counters, and token totals since start
        (engine/observability/stats.py)."""
        return self.recorder.stat_logger

    # ---- the executor -------------------------------------------------------------------

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
        resumed_output_token_ids: ResumedOutputTokenIds | None = None,
        fairness_key: str | None = None,
        fairness_weight: float = 1.0,
    ) -> None:
        """Queues a request. `prompt` is text or ``{"prompt_token_ids": [...]}``.

        `priority` (higher first) orders requests under `scheduling_policy="priority"`.
        `fairness_key` names who the request is served for (a tenant, a user): under
        `fairness="vtc"` (the default) the engine shares the batch between keys in
        proportion to their `fairness_weight` (a positive number; a key's latest request
        sets it), and `priority` orders requests within a key. None: the default key,
        shared by every request that names none (so without keys nothing changes).

        With `PoolingParams` it is a pooling request: its one output is a
        `PoolingRequestOutput` holding the prompt's final hidden states pooled as the
        engine's `PoolerConfig` says (LAST, MEAN or CLS).

        `resumed_output_token_ids` ({output index: tokens generated so far}) resumes a
        request that was generating elsewhere: only the listed outputs continue, each from
        its tokens so far, which count as output for every limit, penalty, stop check and
        the seeded sampler's position (engine/processing/resume.py)."""
        request = EngineRequest.build(
            request_id,
            prompt,
            params,
            arrival_time,
            lora_request,
            trace_headers,
            priority,
            resumed_output_token_ids,
            fairness_key,
            fairness_weight,
        )
        self.add_engine_request(request)

    def add_engine_request(self, request: EngineRequest) -> None:
        """Queues a request the front has built (`EngineRequest.build`, as `add_request`
        does and `AsyncLLMEngine.generate` on its own side)."""
        request_id = request.request_id
        if request.lora_request is not None:
            self._require_lora()
            self._ensure_lora(request.lora_request)  # loads and checks it if new
        self.request_builder.check_priority(request)
        if self.output_processor.has_request(request_id) or request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request.")
        new = self.request_builder.build(request)
        params, headers, samples = new.params, new.trace_headers, new.samples
        if isinstance(params, PoolingParams):
            self.output_processor.add_pooling_request(new.text, samples[0])
            self.scheduler.add_request(samples[0])
            self.recorder.track(request_id, headers, params, samples)
            return
        if any(s.request_id in self.scheduler.requests for s in samples):
            raise ValueError(f"request_id {request_id!r} collides with a live request's sample.")
        self.output_processor.add_request(
            request_id, new.text, new.prompt_token_ids, params, samples
        )
        for sample in samples:
            if params.structured_outputs is not None:
                self.structured_output_manager.add_request(sample)
            self.scheduler.add_request(sample)
        self.recorder.track(request_id, headers, params, samples)

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
                self.recorder.untrack(rid)
        self.recorder.update_gauges()

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
            self.recorder.record_step(scheduler_output)
        # Async scheduling: a step launched after the last requests' final step holds only
        # their dropped rows; collected now, so nothing is left in flight when idle.
        while self._in_flight and not self.scheduler.has_unfinished_requests():
            self._in_flight.popleft()
            self.executor.collect()
        self.recorder.record_finished(outputs)
        self.recorder.update_gauges()
        return outputs

    def _steps_in_flight(self, config: EngineConfig) -> int:
        """Steps the engine keeps submitted: the executor's, or two with async scheduling
        (whose placeholders the scheduler then counts)."""
        if not config.async_scheduling:
            return self.executor.max_concurrent_batches
        reason = async_scheduling.unsupported_reason(config.parallel_config)
        if reason is not None:
            logger.warning("async_scheduling is off: %s.", reason)
            return self.executor.max_concurrent_batches
        self.scheduler.async_scheduling = True
        return 2

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
        takes (one without pipeline parallelism; two with async scheduling, unless the
        last step's requests need their tokens on the host first) or nothing more can be
        scheduled."""
        while (
            len(self._in_flight) < self._max_in_flight and self.scheduler.has_unfinished_requests()
        ):
            if self.scheduler.async_scheduling and self._in_flight:
                blocker = async_scheduling.overlap_blocker(
                    self._in_flight[-1],
                    self.scheduler.proposer is not None,
                    penalties_on_device=self._penalties_on_device,
                )
                if blocker is not None:  # this step runs synchronously
                    return
            scheduler_output = self.scheduler.schedule(self._batch_cap())
            if scheduler_output.is_empty:
                self.executor.skip(scheduler_output)
                if not self._in_flight:
                    # Only requests whose grammar is compiling: wait rather than spin.
                    self.structured_output_manager.wait_for_compilation(_IDLE_WAIT_S)
                return
            self.executor.submit(scheduler_output)
            self._in_flight.append(scheduler_output)

    def _abort_failed_grammars(self) -> None:
        """A grammar that passed the check at add_request but failed to compile (rare: the
        vocabulary-level step refused it) aborts its request; the reason is logged."""
        for sample_id in self.structured_output_manager.take_failed():
            request = self.scheduler.requests.get(sample_id)
            if request is not None:
                self.abort_request(request.parent_id)

    def do_log_stats(self) -> str:
        """Logs (and returns) one line: requests, KV-cache use, throughput, prefix hits; with
        speculative decoding, a second line with the draft acceptance rate since the last."""
        return self.recorder.do_log_stats()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()
