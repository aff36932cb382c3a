"""Sleep mode: give the model's memory back while the engine idles, take it again on wake-up.

vLLM's semantics (`LLM.sleep` / `wake_up`, RLHF loops that share a GPU between training and
inference)::

    level  KV cache  weights on CUDA        weights on CPU   wake_up restores
    1      freed     moved to host memory   kept in place    cache (zeroed); weights copied back
    2      freed     freed                  freed            cache (zeroed); weights reloaded
                                                             from the model files

`wake_up(tags)` restores a part at a time: tags ``["weights"]`` or ``["kv_cache"]`` (None:
both), so a caller can reload weights before the cache is allocated. The engine sleeps
until every part is back. The KV cache's contents are lost, so the prefix cache is reset
before sleeping (the engine does it, `LLMEngine.sleep`).

Freed host memory goes back to the OS (glibc `malloc_trim`), so the process RSS drops;
on CUDA the caching allocator's blocks are released (`torch.cuda.empty_cache`).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import sys
from typing import TYPE_CHECKING

import torch

from engine.loader.model_loader import load_model

if TYPE_CHECKING:
    from engine.worker.device_runtime import DeviceRuntime
    from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

SLEEP_TAGS = ("weights", "kv_cache")


class SleepMode:
    """The runner's sleep state: which parts are asleep, and what wakes them."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.level = 0  # the level slept at; 0 = awake
        self.sleeping_tags: set[str] = set()  # the parts not restored yet
        self._host_weights: dict[str, torch.Tensor] | None = None  # level 1 on CUDA

    @property
    def is_sleeping(self) -> bool:
        return self.level != 0

    def sleep(self, level: int) -> None:
        if level not in (1, 2) or isinstance(level, bool):
            raise ValueError(f"level must be 1 or 2, got {level!r}.")
        if self.is_sleeping:
            raise RuntimeError(f"The engine is already asleep (level {self.level}).")
        runner = self.runner
        # The fused decode path and the CUDA graphs hold raw addresses of the weights and
        # caches.
        runner.unbind_decode_step()
        runner.release_cuda_graphs()
        runner.kv_caches = []
        tags = {"kv_cache"}
        if level == 2:
            runner.model = None  # type: ignore[assignment]
            tags.add("weights")
        elif runner.runtime is not None:  # a GPU: the weights wait in host memory
            self._host_weights = _offload(runner.model, runner.runtime)
            tags.add("weights")
        self.level, self.sleeping_tags = level, tags
        _release_memory(runner.runtime)
        logger.info("Sleeping (level %d): released %s.", level, " and ".join(sorted(tags)))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restores the `tags` parts (None: all); a part that is awake is left alone."""
        wanted = _check_tags(tags)
        if not self.is_sleeping:
            return
        runner = self.runner
        if "weights" in wanted & self.sleeping_tags:
            if self.level == 2:
                runner.model = _reload(runner)
                if runner.lora_manager is not None:  # its hooks were on the old model
                    runner.lora_manager.attach(runner.model)
            else:
                assert self._host_weights is not None
                _restore(runner.model, self._host_weights, runner)
                self._host_weights = None
            self.sleeping_tags.discard("weights")
        if "kv_cache" in wanted & self.sleeping_tags:
            runner.kv_caches = runner._allocate_kv_caches(runner.num_blocks)
            self.sleeping_tags.discard("kv_cache")
        if not self.sleeping_tags:
            runner.bind_decode_step()
            runner.capture_cuda_graphs()
            logger.info("Awake (from level %d).", self.level)
            self.level = 0


def _check_tags(tags: list[str] | None) -> set[str]:
    if tags is None:
        return set(SLEEP_TAGS)
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
        raise TypeError(f"tags must be a list of str or None, got {tags!r}.")
    unknown = [t for t in tags if t not in SLEEP_TAGS]
    if unknown:
        raise ValueError(f"tags has unknown entries {unknown}; known: {list(SLEEP_TAGS)}.")
    return set(tags)


def _offload(model: torch.nn.Module, runtime: DeviceRuntime) -> dict[str, torch.Tensor]:
    """Moves every parameter and buffer to host memory (pinned: the copy back is fast);
    on the device each keeps an empty placeholder of its dtype."""
    host = {}
    for name, tensor in _tensors(model):
        host[name] = runtime.to_host(tensor)
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return host


def _restore(model: torch.nn.Module, host: dict[str, torch.Tensor], runner: ModelRunner) -> None:
    for name, tensor in _tensors(model):
        tensor.data = host[name].to(runner.device, non_blocking=True)
    if runner.runtime is not None:
        runner.runtime.synchronize()


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    # Tied weights are one Parameter under two names: named_* lists it once.
    return [*model.named_parameters(), *model.named_buffers()]


def _reload(runner: ModelRunner) -> torch.nn.Module:
    """The model rebuilt from its files, as at start-up."""
    mc = runner.config.model_config
    return load_model(
        mc.model_dir, mc.hf_config, dtype=runner.dtype, device=runner.device,
        attn_backend=runner.attn_backend, quantization=mc.quantization, gguf_file=mc.gguf_file,
        load_format=mc.load_format, seed=mc.seed,
    )  # fmt: skip


def _release_memory(runtime: DeviceRuntime | None) -> None:
    gc.collect()
    if runtime is not None:
        runtime.synchronize()
        runtime.empty_cache()
    _malloc_trim()


def _malloc_trim() -> None:
    """Hands freed heap pages back to the OS. The runner raises glibc's trim threshold so
    that step temporaries stay mapped; a sleeping engine wants the opposite."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # musl and other C libraries
        return
