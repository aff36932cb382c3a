"""`LLMEngine`'s administrative API (vLLM's names): LoRA adapters, sleep mode, profiling.

Each is a thin delegation to what the in-process model runner holds (its `LoRAManager`,
`SleepMode` and `TorchProfiler`), so none of them works when the model lives in rank
processes (`distributed_executor_backend='mp'`): `_require_runner` says so by name.
`LLMEngineAdminMixin` is a base class of `LLMEngine` only; it keeps these methods beside
each other and out of the step loop's file.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.config.engine_config import EngineConfig
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.lora.manager import LoRAManager
    from engine.lora.request import LoRARequest


class LLMEngineAdminMixin:
    # What these methods use of LLMEngine: attributes its __init__ sets, and one method.
    config: EngineConfig
    runner: Any  # None when the model lives in rank processes
    lora_manager: LoRAManager | None
    kv_cache_manager: KVCacheManager
    get_num_unfinished_requests: Callable[[], int]

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
