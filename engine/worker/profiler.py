"""`start_profile()` / `stop_profile()`: a torch.profiler session over engine steps.

As vLLM's `VLLM_TORCH_PROFILER_DIR`, the trace directory comes from the environment
(`PAGEDSERVE_TORCH_PROFILER_DIR`), so an operator turns profiling on for a deployment
without an API change. Each rank writes one Chrome trace (open it in Perfetto or
chrome://tracing); the ranks of one session share its stamp (the engine's clock when it
stopped the session), so a tensor/pipeline-parallel session is one file per rank::

    $PAGEDSERVE_TORCH_PROFILER_DIR/pagedserve-rank<rank>-<unix ms>.pt.trace.json

While a session runs, the model's forward is a named range (`<ModelClass>.forward`), so
the trace shows where each step's forward starts and ends among the aten ops.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

logger = logging.getLogger(__name__)

PROFILER_DIR_ENV = "PAGEDSERVE_TORCH_PROFILER_DIR"


def profiler_dir() -> Path:
    """The trace directory; a ValueError naming the variable when it is unset."""
    value = os.environ.get(PROFILER_DIR_ENV)
    if not value:
        raise ValueError(
            f"Profiling is off: set {PROFILER_DIR_ENV} to the directory that receives the "
            "torch profiler traces, then call start_profile() again."
        )
    return Path(value).expanduser()


class TorchProfiler:
    """One profiling session at a time over the runner's steps (CPU and, on a CUDA
    device, CUDA activities). Runs on the thread that drives the engine."""

    def __init__(self, device: torch.device, rank: int = 0) -> None:
        self.device = device
        self.rank = rank
        self._session: profile | None = None
        self._hooks: list[Any] = []
        self._directory: Path | None = None

    @property
    def is_active(self) -> bool:
        return self._session is not None

    def start(self, model: torch.nn.Module, directory: Path | None = None) -> None:
        """`directory`: where the trace goes (`profiler_dir()` when None; the engine reads
        it in its own process and hands it to every rank)."""
        if self._session is not None:
            raise RuntimeError("A profiling session is already running: call stop_profile().")
        directory = profiler_dir() if directory is None else Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        session = profile(activities=activities, record_shapes=True)
        session.start()
        self._session, self._directory = session, directory
        self._hooks = _name_forward(model)
        logger.info("Torch profiler started; traces go to %s.", directory)

    def stop(self, stamp: int | None = None) -> Path:
        """Ends the session and writes its Chrome trace; returns the file's path. `stamp`
        (unix ms; now when None) names the session in the file name."""
        session, directory = self._session, self._directory
        if session is None or directory is None:
            raise RuntimeError("No profiling session is running: call start_profile() first.")
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._session = [], None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        session.stop()
        if stamp is None:
            stamp = time.time_ns() // 1_000_000
        path = directory / f"pagedserve-rank{self.rank}-{stamp}.pt.trace.json"
        session.export_chrome_trace(str(path))
        logger.info("Torch profiler stopped; trace written to %s.", path)
        return path


def _name_forward(model: torch.nn.Module) -> list[Any]:
    """Hooks that open a `<ModelClass>.forward` range around each call of the model (only
    while profiling: no cost on the hot path otherwise)."""
    label = f"{type(model).__name__}.forward"
    ranges: list[record_function] = []

    def enter(module: torch.nn.Module, args: Any) -> None:
        scope = record_function(label)
        scope.__enter__()
        ranges.append(scope)

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        if ranges:
            ranges.pop().__exit__(None, None, None)

    return [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
