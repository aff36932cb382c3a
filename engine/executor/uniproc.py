"""Executors: where the model runs for an engine (vLLM's `distributed_executor_backend`).

- "uni" (`UniProcExecutor`): the model runner in the engine's own process; a step is
  launched when it is submitted (on a GPU its kernels are queued) and finished when it is
  collected (its sampled ids read back: engine/worker/async_output.py), so with async
  scheduling two steps are in flight (engine/core/async_scheduling.py).
- "mp" (`engine.executor.mp_executor.MultiprocExecutor`): one worker process per
  tensor/pipeline-parallel rank; up to `pipeline_parallel_size` steps in flight.

Both take a step with `submit(scheduler_output)` and give its `ModelRunnerOutput` back,
oldest first, with `collect()`; `skip()` takes the bookkeeping of a step with nothing
scheduled. Everything else the engine asks of the model's side (LoRA adapters, sleep mode,
profiling) is `collective_rpc(method, args, kwargs)`: the `Worker` method of that name run
on every rank, one result per rank (engine/worker/worker.py).

`runner` is the in-process `ModelRunner` for tests and benchmarks that look inside (None
when the model lives in other processes); the engine itself never reads it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from engine.config.resolved import EngineConfig
from engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from engine.executor.mp_executor import MultiprocExecutor
from engine.executor.rank_rpc import DEFAULT_RPC_TIMEOUT_S


class Executor(Protocol):
    runner: Any  # ModelRunner | None: introspection only
    num_blocks: int
    max_concurrent_batches: int

    @property
    def pids(self) -> list[int]:
        """The rank processes that run the model (none when it runs in this process)."""
        ...

    def submit(self, scheduler_output: SchedulerOutput) -> None: ...

    def skip(self, scheduler_output: SchedulerOutput) -> None: ...

    def collect(self) -> ModelRunnerOutput: ...

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
    ) -> list[Any]: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


class UniProcExecutor:
    max_concurrent_batches = 1

    def __init__(self, config: EngineConfig) -> None:
        # torch-side: loaded when an engine is built, not when the engine's front is imported
        from engine.worker.worker import Worker

        self.worker = Worker(config)
        self.runner = self.worker.runner
        self.num_blocks = self.runner.num_blocks
        self._outputs: deque[Any] = deque()  # PendingOutput, oldest first

    @property
    def pids(self) -> list[int]:
        return []  # the model runs in this process

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        pending = self.worker.launch_model(scheduler_output)
        assert pending is not None, "a world of one always answers"
        self._outputs.append(pending)

    def skip(self, scheduler_output: SchedulerOutput) -> None:
        """Nothing to run; the runner still forgets the requests that ended."""
        self.runner.drop_request_state(scheduler_output)

    def collect(self) -> ModelRunnerOutput:
        return self._outputs.popleft().finish()

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
    ) -> list[Any]:
        """[the worker's `method(*args, **kwargs)`]: a direct call, whose exception
        propagates as it is (`timeout_s` does not apply: nothing waits on another process)."""
        from engine.worker.worker import check_rpc_method

        function = getattr(self.worker, check_rpc_method(method))
        return [function(*args, **(kwargs or {}))]

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


def create_executor(config: EngineConfig, on_failure: Callable[[], None] | None = None) -> Executor:
    """The executor `config.parallel_config` asks for."""
    if config.parallel_config.distributed_executor_backend == "mp":
        return MultiprocExecutor(config, on_failure)
    return UniProcExecutor(config)
