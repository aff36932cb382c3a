"""A `DeviceRuntime` on the CPU, so the runner's GPU-only paths run in the CPU tests.

The runner reaches a GPU's memory figures, graph capture and pinned copies only through
`engine/worker/device_runtime.py`; handing it this runtime on the CPU makes it take every
one of those paths (the profile-step budget, decode graphs, sleep level 1's host copies) with
its real forward passes and caches. What cannot run on a CPU is stood in for plainly:

- memory figures are the fixed numbers the test chooses (`total`, `peak`, `reserved`,
  `other`), so the budget's arithmetic is checked exactly;
- a "graph" records nothing: replaying it reruns the forward over the same static input
  buffers and copies the result into the captured output tensor, which is what a CUDA
  graph's replay amounts to for the runner (same buffers in, same output tensor out).

Every call is appended to `events`, so a test checks the order of the steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class HostRuntime:
    def __init__(
        self,
        total: int,
        peak: int,
        reserved: int,
        other: int = 0,
        probe: Callable[[], Any] | None = None,
    ) -> None:
        self.total, self.peak, self.reserved, self.other = total, peak, reserved, other
        self.probe = probe  # called at each capture: what the test wants to see then
        self.events: list[str] = []
        self.probed: list[Any] = []

    def synchronize(self) -> None:
        self.events.append("synchronize")

    def empty_cache(self) -> None:
        self.events.append("empty_cache")

    def reset_peak_memory_stats(self) -> None:
        self.events.append("reset_peak_memory_stats")

    def mem_get_info(self) -> tuple[int, int]:
        self.events.append("mem_get_info")
        return self.total - self.reserved - self.other, self.total

    def max_memory_allocated(self) -> int:
        self.events.append("max_memory_allocated")
        return self.peak

    def memory_reserved(self) -> int:
        self.events.append("memory_reserved")
        return self.reserved

    def graph_pool(self) -> object:
        self.events.append("graph_pool")
        return object()

    def capture_graph(
        self, forward: Callable[[], torch.Tensor], pool: Any
    ) -> tuple[Callable[[], None], torch.Tensor]:
        output = forward()
        self.events.append(f"capture {output.shape[0]}")
        if self.probe is not None:
            self.probed.append(self.probe())

        def replay() -> None:
            output.copy_(forward())

        return replay, output

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        self.events.append("to_host")
        return tensor.detach().clone()
