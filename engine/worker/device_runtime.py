"""What the runner asks of a GPU beyond tensors: memory figures, graph capture, pinned copies.

The runner's CUDA-only paths (sizing the KV cache from free device memory after a profile
step, capturing decode graphs, moving weights to host memory in sleep level 1) read these
through one `DeviceRuntime` instead of calling `torch.cuda` where they stand. So their logic
and its order (the profile step before the cache exists, the graphs after it) can be run on
any device by handing the runner another runtime: the tests do so on the CPU
(tests/engine/worker/host_runtime.py). On the CPU the engine itself has none
(`device_runtime` returns None): its cache budget comes from host memory and it captures no
graphs.

    runner start-up on a GPU        runtime calls
    profile step (scratch caches)   empty_cache, reset_peak_memory_stats, synchronize
    budget                          mem_get_info, max_memory_allocated, memory_reserved
    KV caches, warm-up steps
    decode graphs                   graph_pool, capture_graph (largest size first)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

# replay() re-runs the recorded launches; their result lands in the recorded output tensor.
Replay = Callable[[], Any]


class DeviceRuntime(Protocol):
    """The device operations the runner's accelerator paths use."""

    def synchronize(self) -> None: ...

    def empty_cache(self) -> None: ...

    def reset_peak_memory_stats(self) -> None: ...

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device, all processes counted."""
        ...

    def max_memory_allocated(self) -> int: ...

    def memory_reserved(self) -> int: ...

    def graph_pool(self) -> Any:
        """A memory pool the graphs of one runner share."""
        ...

    def capture_graph(
        self, forward: Callable[[], torch.Tensor], pool: Any
    ) -> tuple[Replay, torch.Tensor]:
        """Records `forward`'s launches: (replay, the output tensor every replay rewrites)."""
        ...

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy the device can copy back from quickly (pinned on CUDA)."""
        ...


class CudaRuntime:
    """`DeviceRuntime` over torch.cuda for one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def max_memory_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def memory_reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def graph_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture_graph(
        self, forward: Callable[[], torch.Tensor], pool: Any
    ) -> tuple[Replay, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = forward()
        return graph.replay, output

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to("cpu").pin_memory()


def device_runtime(device: torch.device) -> DeviceRuntime | None:
    """The runtime of `device`: CUDA's on a CUDA device, None elsewhere (the CPU engine
    sizes its cache from host memory and runs every step eagerly)."""
    if device.type == "cuda":
        return CudaRuntime(device)
    return None
