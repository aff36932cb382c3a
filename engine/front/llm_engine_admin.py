"""`LLMEngine`'s administrative API (vLLM's names): LoRA adapters, sleep mode, profiling.

Each goes through the executor's seam, `collective_rpc(method, args)` (vLLM's): the `Worker`
method of that name runs on every rank, in the engine's process or in each tensor/pipeline
parallel rank process alike (engine/worker/worker.py), so the engine never reaches into a
model runner. A rank's exception is raised here as it is, of the same type.

The engine keeps two things on its side so the step loop never waits on a call to the
ranks: whether the ranks sleep, and the adapters it has added (a request naming a known
adapter goes straight to the scheduler; the ranks load one they evicted again themselves).
`LLMEngineAdminMixin` is a base class of `LLMEngine` only; it keeps these methods beside
each other and out of the step loop's file.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.config.engine_config import EngineConfig
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.executor.uniproc import Executor
    from engine.lora.request import LoRARequest


class LLMEngineAdminMixin:
    # What these methods use of LLMEngine: attributes its __init__ sets, and one method.
    config: EngineConfig
    executor: Executor
    kv_cache_manager: KVCacheManager
    get_num_unfinished_requests: Callable[[], int]
    _sleeping: bool = False  # the ranks' sleep state after the last sleep() / wake_up()
    _added_loras: dict[int, LoRARequest]  # by id: adapters added and not removed

    def _call_workers(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every rank's `Worker`; one result per rank."""
        return self.executor.collective_rpc(method, args)

    # ---- LoRA adapters ------------------------------------------------------------------

    def _require_lora(self) -> None:
        if self.config.lora_config is None:
            raise ValueError("LoRA adapters need enable_lora=True in the engine arguments.")

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads and checks an adapter on every rank (a ValueError says what is wrong with a
        bad one); False if its id is loaded already."""
        self._require_lora()
        added = self._call_workers("add_lora", lora_request)[0]
        self._added_loras[lora_request.lora_int_id] = lora_request
        return added

    def _ensure_lora(self, lora_request: LoRARequest) -> None:
        """A request's adapter: added unless the engine added it already."""
        if self._added_loras.get(lora_request.lora_int_id) != lora_request:
            self.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        self._require_lora()
        self._added_loras.pop(lora_id, None)
        return self._call_workers("remove_lora", lora_id)[0]

    def list_loras(self) -> set[int]:
        """The adapters loaded now (LRU beyond max_cpu_loras may have dropped some)."""
        self._require_lora()
        return self._call_workers("list_loras")[0]

    def pin_lora(self, lora_id: int) -> bool:
        """Keeps the adapter loaded whatever max_cpu_loras' LRU would evict."""
        self._require_lora()
        return self._call_workers("pin_lora", lora_id)[0]

    # ---- sleep mode ---------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Frees the KV cache (level 1; on CUDA the weights move to host memory) or the KV
        cache and the weights (level 2) on every rank, see `worker/sleep.py`. The engine
        must be idle; requests added while it sleeps wait for `wake_up()`."""
        num_unfinished = self.get_num_unfinished_requests()
        if num_unfinished:
            raise RuntimeError(
                f"sleep() needs an idle engine: {num_unfinished} requests are unfinished "
                "(finish or abort them first)."
            )
        if not self._sleeping:
            # The cached blocks' contents go with the cache.
            assert self.kv_cache_manager.reset_prefix_cache(), "an idle engine holds blocks"
        self._call_workers("sleep", level)
        self._sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restores the parts in `tags` ("weights", "kv_cache"; None: all). Steps resume
        once every part is back on every rank."""
        self._call_workers("wake_up", tags)
        self._sleeping = any(self._call_workers("is_sleeping"))

    def is_sleeping(self) -> bool:
        return self._sleeping

    # ---- profiling ----------------------------------------------------------------------

    def start_profile(self) -> None:
        """Starts a torch.profiler session on every rank over the following steps; the
        trace directory is `PAGEDSERVE_TORCH_PROFILER_DIR` (a ValueError naming it when
        unset), read here: the ranks' environment is the one they started with."""
        from engine.worker.profiler import profiler_dir

        self._call_workers("start_profile", str(profiler_dir()))

    def stop_profile(self) -> Path:
        """Ends the session; every rank writes its Chrome trace to the trace directory,
        named by its rank and the session's stamp (the same on every rank)::

            pagedserve-rank<rank>-<unix ms>.pt.trace.json

        Returns rank 0's file; the other ranks' lie beside it, differing only in the rank.
        """
        stamp = time.time_ns() // 1_000_000
        return self._call_workers("stop_profile", stamp)[0]
