"""`AsyncLLMEngine`: the asyncio front of `LLMEngine`, with vLLM's API.

A background thread (`engine_thread.EngineThread`) owns the `LLMEngine` and runs its step
loop, so a forward pass never blocks the event loop. Each `generate()` / `encode()` call
gets an `OutputStream` (an asyncio queue) that the engine thread fills; closing the
generator or cancelling its task aborts the request, which frees its KV blocks.
`generate_into()` hands each output to a callback instead, many requests per step without
a task wake-up each (request_outputs.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.api.errors import EngineDeadError
from engine.api.outputs import PoolingRequestOutput, RequestOutput
from engine.api.sampling_params import SamplingParams
from engine.config.engine_config import (
    CacheConfig,
    DeviceConfig,
    EngineArgs,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
)
from engine.config.parallel import ParallelConfig
from engine.core.engine_request import EngineRequest
from engine.front.engine_commands import AbortCommand, EngineStats
from engine.front.engine_thread import EngineThread, raise_if_dead
from engine.front.llm_engine import LLMEngine, PromptType
from engine.front.request_outputs import generation_request, outputs_into, stream_outputs
from engine.lora.request import LoRARequest
from engine.observability.kv_event_publisher import KVEventBatch, KVEventSubscription
from engine.pooling_params import PoolingParams
from engine.processing.input_processor import InputProcessor
from engine.structured_output.config import DecodingConfig

__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineStats"]


class AsyncLLMEngine:
    """Serves `generate()` / `encode()` calls from asyncio tasks on one `LLMEngine`.

    >>> engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=...))
    >>> async for output in engine.generate("Hi", SamplingParams(max_tokens=8), "req-1"):
    ...     print(output.outputs[0].text)
    """

    def __init__(
        self, engine: LLMEngine, start_engine_loop: bool = True, log_requests: bool = False
    ) -> None:
        self.engine = engine  # used by whoever drives it: the loop thread or engine_step()
        self.log_requests = log_requests
        self._loop_thread = EngineThread(engine, log_requests=log_requests)
        if start_engine_loop:
            self.start_background_loop()

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, start_engine_loop: bool = True
    ) -> AsyncLLMEngine:
        return cls(
            LLMEngine.from_engine_args(engine_args),
            start_engine_loop=start_engine_loop,
            log_requests=engine_args.enable_log_requests,
        )

    # ---- the background loop -------------------------------------------------------------

    def start_background_loop(self) -> None:
        """Starts the loop that steps the engine; again after `shutdown_background_loop()`.
        Raises `EngineDeadError` once the engine is shut down or dead."""
        self._loop_thread.start()

    def shutdown_background_loop(self, timeout: float | None = 30.0) -> None:
        """Stops the loop after its current step, keeping every request and the engine:
        `start_background_loop()` resumes them, `engine_step()` steps them by hand. Calls
        made meanwhile (generate, abort) wait for one or the other."""
        self._loop_thread.pause(timeout)

    async def engine_step(self, virtual_engine: int = 0) -> bool:
        """One engine iteration by hand (the background loop must be off): applies the
        submitted adds and aborts, runs one step and hands its outputs to their generators.
        Returns True while requests remain unfinished (vLLM's contract). One scheduler
        serves every virtual engine (pipeline batch slot): any valid one steps them all."""
        num_virtual = self.engine.get_parallel_config().pipeline_parallel_size
        if not isinstance(virtual_engine, int) or not 0 <= virtual_engine < num_virtual:
            raise ValueError(
                f"virtual_engine must be in [0, {num_virtual}) (pipeline_parallel_size="
                f"{num_virtual}), got {virtual_engine!r}."
            )
        return await asyncio.to_thread(self._loop_thread.step_once)

    # ---- state ----------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._loop_thread.is_alive and self._loop_thread.dead_error is None

    @property
    def errored(self) -> bool:
        """True once the engine can serve no more: its loop died or it was shut down (as
        vLLM's `AsyncLLM.errored`). A paused background loop is not an error."""
        return self._loop_thread.dead_error is not None

    @property
    def is_stopped(self) -> bool:
        """True once the engine is shut down or dead (vLLM: `is_stopped` is `errored`)."""
        return self.errored

    @property
    def dead_error(self) -> BaseException:
        return self._loop_thread.dead_error or EngineDeadError("The engine is not dead.")

    async def check_health(self) -> None:
        """Raises `EngineDeadError` once the engine is dead or shut down. A background loop
        paused by `shutdown_background_loop()` is healthy (as in vLLM): it can restart."""
        raise_if_dead(self._loop_thread.dead_error)

    async def get_model_config(self) -> ModelConfig:
        return self.engine.get_model_config()

    async def get_engine_config(self) -> EngineConfig:
        return self.engine.get_engine_config()

    async def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    async def get_cache_config(self) -> CacheConfig:
        return self.engine.get_cache_config()

    async def get_scheduler_config(self) -> SchedulerConfig:
        return self.engine.get_scheduler_config()

    async def get_device_config(self) -> DeviceConfig:
        return self.engine.get_device_config()

    async def get_decoding_config(self) -> DecodingConfig:
        """Which grammar backend enforces structured outputs."""
        return self.engine.get_decoding_config()

    async def get_parallel_config(self) -> ParallelConfig:
        return self.engine.get_parallel_config()

    async def get_lora_config(self) -> LoRAConfig | None:
        return self.engine.get_lora_config()

    async def get_input_preprocessor(self) -> InputProcessor:
        return self.engine.get_input_preprocessor()

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return await self._loop_thread.call(lambda engine: engine.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._loop_thread.call(lambda engine: engine.remove_lora(lora_id))

    async def list_loras(self) -> set[int]:
        return await self._loop_thread.call(lambda engine: engine.list_loras())

    async def pin_lora(self, lora_id: int) -> bool:
        return await self._loop_thread.call(lambda engine: engine.pin_lora(lora_id))

    async def sleep(self, level: int = 1) -> None:
        """`LLMEngine.sleep(level)` between steps (the engine must be idle). Requests sent
        while it sleeps wait for `wake_up()`; `check_health()` stays healthy."""
        await self._loop_thread.call(lambda engine: engine.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._loop_thread.call(lambda engine: engine.wake_up(tags))

    async def is_sleeping(self) -> bool:
        # One int read: safe from any thread, and current once sleep()/wake_up() returned
        # (the stats snapshot follows a step later).
        return self.engine.is_sleeping()

    async def start_profile(self) -> None:
        """`LLMEngine.start_profile()` on the engine thread (the one running the steps)."""
        await self._loop_thread.call(lambda engine: engine.start_profile())

    async def stop_profile(self) -> Path:
        """`LLMEngine.stop_profile()`: ends the session; returns the trace file's path."""
        return await self._loop_thread.call(lambda engine: engine.stop_profile())

    async def reset_prefix_cache(self) -> bool:
        """Drops every cached block no request holds (on the engine thread, between
        steps); False when some blocks are in use, as vLLM."""
        return await self._loop_thread.call(lambda engine: engine.reset_prefix_cache())

    def step_running_s(self) -> float:
        """Seconds the engine step now running has taken so far; 0.0 between steps (safe
        from any thread: a watchdog calls it while the engine thread may be stuck)."""
        started = self._loop_thread.step_started_at
        return 0.0 if started is None else max(0.0, time.monotonic() - started)

    def step_workers(self) -> tuple[int | None, list[int]]:
        """Who runs the steps: the native id of the thread that ran the latest step (None
        before the first) and the rank processes besides this one (none with one rank). The
        stall watchdog counts their CPU time as the step's progress."""
        return self._loop_thread.step_thread_id, list(self.engine.executor.pids)

    def get_stats(self) -> EngineStats:
        """The snapshot taken after the latest step (safe from any thread)."""
        return self._loop_thread.stats

    @property
    def metrics_registry(self) -> Any:
        """The engine's Prometheus `CollectorRegistry` (`LLMEngine.metrics`), for a
        `/metrics` endpoint; its metrics are safe to read from any thread."""
        return self.engine.metrics.registry

    async def do_log_stats(self) -> str:
        """Logs (and returns) the engine's stats line (`LLMEngine.do_log_stats`), computed
        on the engine thread, which owns the counters it reads and resets."""
        return await self._loop_thread.call(lambda engine: engine.do_log_stats())

    async def subscribe_kv_events(
        self, max_queued_batches: int = 1024
    ) -> AsyncGenerator[KVEventBatch, None]:
        """The prefix cache's events (engine/core/kv_events.py), one batch per step that
        changed it, after a first batch listing every block cached at subscription. Ends
        when the engine stops, or when the subscriber falls `max_queued_batches` behind."""
        publisher = self._loop_thread.kv_events
        subscription = KVEventSubscription(asyncio.get_running_loop(), max_queued_batches)
        await self._loop_thread.call(lambda engine: publisher.add_subscriber(subscription))
        try:
            while not self.errored:
                with contextlib.suppress(asyncio.TimeoutError):
                    batch = await asyncio.wait_for(subscription.queue.get(), 1.0)
                    if batch is None:
                        return
                    yield batch
        finally:
            publisher.remove_subscriber(subscription)

    def num_running(self) -> int:
        return self.get_stats().num_running

    def num_waiting(self) -> int:
        return self.get_stats().num_waiting

    async def wait_until_idle(self, timeout: float = 30.0) -> None:
        """Waits until every submitted add/abort is applied and no request is left."""
        deadline = time.monotonic() + timeout
        while True:
            raise_if_dead(self._loop_thread.dead_error)
            num_submitted = self._loop_thread.num_submitted
            stats = self.get_stats()
            if (
                stats.num_commands_applied >= num_submitted
                and stats.num_requests == stats.num_running == stats.num_waiting == 0
            ):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"The engine is still busy after {timeout} s: {stats}.")
            await asyncio.sleep(0.002)

    # ---- requests ---------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        lora_request: Any = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        resumed_output_token_ids: Mapping[int, Sequence[int]] | None = None,
        fairness_key: str | None = None,
        fairness_weight: float = 1.0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Streams the request's outputs (as `sampling_params.output_kind` asks) until the
        one with `finished=True`. Closing the generator or cancelling its task aborts the
        request. Errors of `LLMEngine.add_request` are raised here unchanged.

        `resumed_output_token_ids` continues a request moved from another engine, as in
        `LLMEngine.add_request` (engine/processing/resume.py). `priority`, `fairness_key` and
        `fairness_weight` as in `LLMEngine.add_request`: the engine shares the batch fairly
        between fairness keys (tenants)."""
        request = generation_request(
            prompt,
            sampling_params,
            request_id,
            lora_request,
            trace_headers,
            priority,
            resumed_output_token_ids,
            fairness_key,
            fairness_weight,
        )
        stream = stream_outputs(self._loop_thread, request)
        async with contextlib.aclosing(stream):
            async for output in stream:
                yield output

    async def generate_into(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        on_output: Callable[[RequestOutput], None],
        lora_request: Any = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        resumed_output_token_ids: Mapping[int, Sequence[int]] | None = None,
        fairness_key: str | None = None,
        fairness_weight: float = 1.0,
    ) -> None:
        """`generate` for a consumer that takes each output as it comes: `on_output(output)`
        runs on the event loop inside the engine thread's one hand-over per step, so many
        requests cost no task wake-up per request and step (the engine service's
        GenerateStream builds one batch message from them). Returns once the request's
        finished output was handed over. Cancelling the caller aborts the request, and
        nothing is handed over after; an error of `on_output` aborts it and is raised here.
        The arguments and their errors are `generate`'s."""
        request = generation_request(
            prompt,
            sampling_params,
            request_id,
            lora_request,
            trace_headers,
            priority,
            resumed_output_token_ids,
            fairness_key,
            fairness_weight,
        )
        await outputs_into(self._loop_thread, request, on_output)

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        lora_request: Any = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        fairness_key: str | None = None,
        fairness_weight: float = 1.0,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Yields the one `PoolingRequestOutput` of a pooling request; an aborted request
        ends without yielding."""
        if not isinstance(pooling_params, PoolingParams):
            raise TypeError(
                f"pooling_params must be PoolingParams, got {type(pooling_params).__name__}."
            )
        request = EngineRequest.build(
            request_id,
            prompt,
            pooling_params,
            time.time(),
            lora_request,
            trace_headers,
            priority,
            fairness_key=fairness_key,
            fairness_weight=fairness_weight,
        )
        stream = stream_outputs(self._loop_thread, request)
        async with contextlib.aclosing(stream):
            async for output in stream:
                yield output

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Aborts requests (unknown or finished ids are ignored); their blocks are freed and
        their generators end (`generate` with a finish_reason "abort" output)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with contextlib.suppress(EngineDeadError):
            self._loop_thread.submit(AbortCommand(ids))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops the engine loop. In-flight `generate` calls end with their abort output,
        in-flight `encode` calls raise `EngineDeadError`, as do later calls. The rank
        processes of a multi-process engine exit."""
        try:
            self._loop_thread.stop(timeout)
        finally:
            self.engine.shutdown()
