"""Both routes of a two-route layer (engine/layers/crossover.py: a decode-row kernel and a
GEMM) timed per row count, as the engine's calibration times them, for
benchmarks/gpu/fp8_gemm.py and benchmarks/gpu/int4_linear.py.

Each timing runs the route over several copies of the layer whose weights together exceed
twice the L2 cache (a decode step streams every weight from memory once; one copy would be
served from L2 after the first call), in a CUDA graph (`cuda_event_timer`). Printed per row
count: microseconds per layer of each route, the bytes each reads (weights + activations +
output) per second and as a share of the device's copy bandwidth, and at the end the
crossover the engine would pick from these timings (`choose_crossover`). On a CPU (`--smoke`
runs: the kernels in Triton's interpreter) the timer is the host clock, and the figures say
only that the wiring runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.layers.crossover import (
    Timer,
    Trial,
    choose_crossover,
    cuda_event_timer,
    set_kernel_rows,
    two_route_methods,
)

ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


def host_timer(trial: Trial) -> float:
    """Seconds per call by the host clock (CPU smoke runs), median of three."""
    trial.call()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        trial.call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def timer_for(device: torch.device) -> Timer:
    return cuda_event_timer if device.type == "cuda" else host_timer


def num_copies(layer_bytes: int, device: torch.device, most: int = 16) -> int:
    """Copies of a layer whose weights together exceed twice the L2 cache (1 on a CPU)."""
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(most, -(-2 * l2 // layer_bytes)))


def sweep(
    name: str,
    methods: list[Any],  # TwoRoutes, all of one shape (the copies)
    layer_bytes: int,  # what one route call reads of the weight (codes, scales, zeros)
    out_features: int,
    rows: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    copy_gbps: float,
    timer: Timer,
) -> dict[str, Any]:
    """{rows: {kernel_us, gemm_us, kernel_gbps, gemm_gbps, ...}, "crossover": rows}."""
    k = methods[0].in_features
    generator = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {}
    table = []
    for m in rows:
        x = torch.randn(m, k, generator=generator).to(dtype).to(device)
        moved = layer_bytes + (m * k + m * out_features) * x.element_size()
        figures = {}
        for route in ("kernel", "gemm"):
            call = _call_all(methods, x, route == "kernel")
            seconds = timer(Trial(name, route, m, len(methods), call)) / len(methods)
            gbps = moved / seconds / 1e9
            figures[f"{route}_us"] = seconds * 1e6
            figures[f"{route}_gbps"] = gbps
            figures[f"{route}_share_of_copy"] = gbps / copy_gbps if copy_gbps else None
        table.append((m, figures["kernel_us"], figures["gemm_us"]))
        result[str(m)] = figures
        print(
            f"{name} rows {m:4d}: kernel {figures['kernel_us']:8.1f} us "
            f"{figures['kernel_gbps']:6.0f} GB/s {_share(figures['kernel_share_of_copy'])}, "
            f"GEMM {figures['gemm_us']:8.1f} us {figures['gemm_gbps']:6.0f} GB/s "
            f"{_share(figures['gemm_share_of_copy'])}",
            flush=True,
        )
    result["crossover"] = choose_crossover(table)
    print(f"{name}: the kernel up to {result['crossover']} rows (the engine's rule)", flush=True)
    return result


def _share(share: float | None) -> str:
    return "" if share is None else f"({100 * share:5.1f} % of copy)"


def _call_all(methods: list[Any], x: torch.Tensor, kernel: bool) -> Callable[[], None]:
    def call() -> None:
        for method in methods:
            method.route(x, kernel)

    return call


def engine_crossovers(model: torch.nn.Module) -> dict[str, int]:
    """The rows up to which each shape of a loaded model takes its kernel (the engine's
    calibrated or default crossovers), printed."""
    chosen = {key: methods[0].max_kernel_rows for key, methods in two_route_methods(model).items()}
    for key, rows in chosen.items():
        print(f"engine crossover {key}: the kernel up to {rows} rows", flush=True)
    return chosen


def with_kernel_rows(runner: Any, rows: int | dict[str, int]) -> None:
    """Every two-route layer of the runner's model takes its kernel up to `rows` (one count,
    or the per-key counts `engine_crossovers` returned), and the decode graphs are
    captured again (a graph replays the kernels it was captured with)."""
    if isinstance(rows, int):
        set_kernel_rows(runner.model, rows)
    else:
        for key, methods in two_route_methods(runner.model).items():
            for method in methods:
                method.max_kernel_rows = rows[key]
    runner.capture_cuda_graphs()
