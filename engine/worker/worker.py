"""`Worker`: one rank's model runner and everything the engine asks of it besides steps.

The engine never reaches into a runner: every call that is not a step goes through the
executor's `collective_rpc(method, args, kwargs)` (vLLM's seam), which runs the `Worker`
method of that name on every rank and returns one result per rank::

    LLMEngine.add_lora(request)
      -> executor.collective_rpc("add_lora", (request,))
           uni:  [worker.add_lora(request)]                    in the engine's process
           mp:   ("rpc", ...) to each rank process over its pipe, replies gathered
                  -> [rank 0's result, rank 1's result, ...]

So LoRA adapters, sleep mode and profiling work the same with one process or with tensor
and pipeline parallel ranks: each rank loads its shard of an adapter, frees its share of
the KV cache and weights, and writes its own profiler trace.

Only the public methods below may be called that way (`rpc_method` checks the name).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config.resolved import EngineConfig
from engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from engine.lora.manager import LoRAManager
from engine.lora.request import LoRARequest
from engine.worker.async_output import PendingOutput
from engine.worker.model_runner import ModelRunner


def check_rpc_method(method: Any) -> str:
    """`method` if it names a public `Worker` method; a ValueError naming it otherwise
    (checked by the engine's side before anything is sent to a rank)."""
    if (
        not isinstance(method, str)
        or method.startswith("_")
        or not callable(getattr(Worker, method, None))
    ):
        public = sorted(n for n in vars(Worker) if not n.startswith("_"))
        raise ValueError(f"method must name a public Worker method ({public}), got {method!r}.")
    return method


class Worker:
    def __init__(self, config: EngineConfig, allocate_kv_cache: bool = True) -> None:
        self.config = config
        self.runner = ModelRunner(config, allocate_kv_cache=allocate_kv_cache)
        self.num_steps = 0
        if config.lora_config is not None:
            # Each rank's manager cuts its shard of every adapter out of the full tensors
            # (engine/lora/manager.py) and hooks only this stage's layers.
            manager = LoRAManager(
                config.lora_config, config.model_config.hf_config, self.runner.dtype,
                self.runner.device,
            )  # fmt: skip
            manager.attach(self.runner.model)
            self.runner.lora_manager = manager

    # ---- steps --------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's output on the driver rank; None on the others."""
        output = self.runner.execute(scheduler_output)
        self.num_steps += 1
        return output

    def launch_model(self, scheduler_output: SchedulerOutput) -> PendingOutput | None:
        """The step launched (`ModelRunner.launch`); its `finish()` gives the output."""
        pending = self.runner.launch(scheduler_output)
        self.num_steps += 1
        return pending

    def collective_stats(self) -> dict[str, float]:
        """Steps run, and time spent in collectives (`CollectiveStats`)."""
        from engine.distributed.communication import COLLECTIVE_STATS

        return {"num_steps": self.num_steps, **COLLECTIVE_STATS.as_dict()}

    # ---- LoRA adapters ------------------------------------------------------------------

    def _lora(self) -> LoRAManager:
        manager = self.runner.lora_manager
        if manager is None:
            raise ValueError("LoRA adapters need enable_lora=True in the engine arguments.")
        return manager

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self._lora().add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora().remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self._lora().list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        return self._lora().pin_lora(lora_id)

    # ---- sleep mode ---------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        self.runner.sleep_mode.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.runner.sleep_mode.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.runner.sleep_mode.is_sleeping

    # ---- profiling ----------------------------------------------------------------------

    def start_profile(self, directory: str | None = None) -> None:
        """`directory`: the trace directory the engine read (its environment's)."""
        path = None if directory is None else Path(directory)
        self.runner.profiler.start(self.runner.model, path)

    def stop_profile(self, stamp: int | None = None) -> Path:
        """Writes this rank's trace; `stamp` (the same on every rank) names the session."""
        return self.runner.profiler.stop(stamp)
