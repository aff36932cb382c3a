"""Where a layer switches from its decode-row kernel to a GEMM: measured per weight shape on
the GPU at load, before CUDA graphs are captured.

Two quantized layers compute one product two ways (a `TwoRoutes` method):

    FP8  (engine/layers/fp8_linear.py)   kernel: the W8A16 GEMV (kernels/fp8_gemv.py)
                                         GEMM:   per-token quantization + `torch._scaled_mm`
    INT4 (engine/layers/int4_linear.py)  kernel: the dequantize-GEMM (kernels/int4_gemm.py)
                                         GEMM:   `int4_dequantize` then cuBLAS
    block FP8                            kernel: the W8A16 block GEMM (kernels/fp8_block_gemm.py)
    (engine/layers/fp8_block_linear.py)  GEMM:   the W8A8 one on FP8 tensor cores
                                                 (kernels/fp8_block_w8a8.py; sm_89+ only)

    rows <= method.max_kernel_rows  ──▶ kernel        (decode: reads the weight once, narrow)
    more rows                       ──▶ GEMM          (prefill: compute-bound, a library wins)

Where the two cross depends on the GPU, the shape and the dtype, so `plan_crossovers` times
both routes on the loaded model: per distinct `crossover_key` (e.g. "fp8 6144x4096 bfloat16"),
at the row counts of `CALIBRATION_ROWS` in order, each a `Trial` whose call runs the route
over up to `ROTATE_LAYERS` layers of that shape (their weights together exceed the L2 cache,
as in a real step), timed by `cuda_event_timer` (the calls in a CUDA graph, as decode steps
run; CUDA events around replays, the median of a few). The
crossover is the largest row count up to which the kernel was never slower
(`choose_crossover`); timing stops at the first row count the GEMM wins. Results are kept
per process by (device name, key) and logged once.

Fixed before capture: a CUDA graph replays the kernels launched when it was captured, so a
threshold must not move after capture. `plan_crossovers` runs from the loader
(engine/loader/model_loader.py), before the runner's profile run and capture, refuses to run
inside a capture, and a shape timed once keeps its crossover for the life of the process (a
wake-up's recapture sees the same choice per row count).

``$PAGEDSERVE_KERNEL_ROWS``: ``auto`` (unset: measure on CUDA), ``off`` (no measurement: the
layers' defaults, FP8 `FP8_GEMV_MAX_ROWS`, INT4 `INT4_GEMM_MAX_ROWS`, block FP8
`BLOCK_FP8_W8A16_MAX_ROWS`), or a row count (every
two-route layer takes its kernel up to it; 0: never). On the CPU nothing is measured and
nothing changes (no Triton routes there).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

logger = logging.getLogger(__name__)

KERNEL_ROWS_ENV = "PAGEDSERVE_KERNEL_ROWS"
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
ROTATE_LAYERS = 8  # an 8B model's smallest shape x 8 layers: ~130 MB, past any L2
_REPEATS, _ITERS = 5, 5

# (device name, crossover key) -> rows: what this process measured (fixed once measured).
_MEASURED: dict[tuple[str, str], int] = {}


@runtime_checkable
class TwoRoutes(Protocol):
    """A linear method with a kernel route for few rows and a GEMM route for many."""

    max_kernel_rows: int

    def crossover_key(self) -> str | None:
        """What its timings depend on (None: one route only, e.g. on the CPU)."""

    def route(self, x: torch.Tensor, kernel: bool) -> torch.Tensor:
        """x [M, K] @ W.T by the kernel (True) or the GEMM (False): [M, N], no bias."""

    @property
    def in_features(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Trial:
    """One timing: `call` runs `route` ("kernel" / "gemm") at `rows` rows over
    `num_layers` layers of the shape `key`."""

    key: str
    route: str
    rows: int
    num_layers: int
    call: Callable[[], object]


Timer = Callable[[Trial], float]  # seconds per call of trial.call


def cuda_event_timer(trial: Trial) -> float:
    """Median over `_REPEATS` of `_ITERS` calls between two CUDA events: the calls captured
    in one CUDA graph and replayed, as the engine's decode steps run (eager launches would
    time the host's launch path, not the kernels: a Triton launch costs more host time than
    a one-row GEMV takes on the GPU); eager where the call cannot be captured. The first
    calls, outside any capture, compile and autotune the kernel."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            trial.call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(_ITERS):
                trial.call()
        run: Callable[[], object] = graph.replay
        per_run = _ITERS
    except RuntimeError as error:
        logger.warning("%s %s: timed eagerly (%s).", trial.key, trial.route, error)
        run, per_run = trial.call, 1
    samples = []
    for _ in range(_REPEATS):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3 / per_run)
    del graph
    return statistics.median(samples)


def kernel_rows_setting() -> int | str:
    """$PAGEDSERVE_KERNEL_ROWS: "auto" (unset), "off", or a row count >= 0."""
    value = os.environ.get(KERNEL_ROWS_ENV, "").strip().lower() or "auto"
    if value in ("auto", "off"):
        return value
    if value.isdigit():
        return int(value)
    raise ValueError(f"${KERNEL_ROWS_ENV} must be auto, off or a row count >= 0: {value!r}")


def choose_crossover(table: list[tuple[int, float, float]]) -> int:
    """The largest row count of `table` ((rows, kernel time, GEMM time), rows ascending) up
    to which the kernel was never slower; 0 when the GEMM wins at the first."""
    crossover = 0
    for rows, kernel, gemm in table:
        if kernel > gemm:
            break
        crossover = rows
    return crossover


def measure_crossover(
    key: str,
    methods: list[TwoRoutes],
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer,
    rows: tuple[int, ...] = CALIBRATION_ROWS,
) -> tuple[int, list[tuple[int, float, float]]]:
    """(crossover, the timings up to where the GEMM first won) for one shape. A route that
    fails at some row count (a kernel that does not compile on this GPU, memory) ends the
    measurement there, with a warning: the rows measured before it decide (none: the GEMM
    everywhere), so a failed measurement never stops the engine from starting."""
    methods = methods[:ROTATE_LAYERS]
    generator = torch.Generator().manual_seed(0)
    table: list[tuple[int, float, float]] = []
    for m in rows:
        x = torch.randn(m, methods[0].in_features, generator=generator).to(dtype).to(device)
        times = []
        try:
            for route in ("kernel", "gemm"):
                times.append(timer(Trial(key, route, m, len(methods), _call(methods, x, route))))
        except Exception:  # any failure of a route: the rows before it decide
            logger.warning(
                "%s: the %s route failed at %d rows; the crossover is taken from fewer rows.",
                key, ("kernel", "gemm")[len(times)], m, exc_info=True,
            )  # fmt: skip
            break
        table.append((m, times[0], times[1]))
        if times[0] > times[1]:
            break
    return choose_crossover(table), table


def _call(methods: list[TwoRoutes], x: torch.Tensor, route: str) -> Callable[[], None]:
    kernel = route == "kernel"

    def call() -> None:
        for method in methods:
            method.route(x, kernel)

    return call


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def two_route_methods(model: nn.Module) -> dict[str, list[TwoRoutes]]:
    """The model's two-route methods by crossover key (methods with one route left out)."""
    groups: dict[str, list[TwoRoutes]] = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, TwoRoutes) and (key := method.crossover_key()) is not None:
            groups.setdefault(key, []).append(method)
    return groups


def plan_crossovers(
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer | None = None,
    rows: tuple[int, ...] = CALIBRATION_ROWS,
) -> dict[str, int]:
    """Sets `max_kernel_rows` on every two-route method of `model` (see the module doc);
    returns the crossover per key ({} where nothing was set: the CPU, or "off"). `timer`
    replaces the CUDA-event timer (tests); without one only a CUDA model is measured."""
    if timer is None and device.type != "cuda":
        return {}
    setting = kernel_rows_setting()
    if setting == "off":
        return {}
    groups = two_route_methods(model)
    if not groups:
        return {}
    if _capturing():
        raise RuntimeError("crossovers are measured before CUDA graph capture, not during it.")
    if isinstance(setting, int):
        chosen = dict.fromkeys(groups, setting)
    else:
        chosen = _measured(groups, dtype, device, timer or cuda_event_timer, rows)
    for key, methods in groups.items():
        for method in methods:
            method.max_kernel_rows = chosen[key]
    return chosen


def _measured(
    groups: dict[str, list[TwoRoutes]],
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer,
    rows: tuple[int, ...],
) -> dict[str, int]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    start = time.perf_counter()
    chosen, lines = {}, []
    for key, methods in groups.items():
        if (name, key) not in _MEASURED:
            crossover, table = measure_crossover(key, methods, dtype, device, timer, rows)
            _MEASURED[(name, key)] = crossover
            n = min(len(methods), ROTATE_LAYERS)
            timings = ", ".join(f"{m}: {k / n * 1e6:.1f}/{g / n * 1e6:.1f}" for m, k, g in table)
            lines.append(f"{key}: kernel up to {crossover} rows (us kernel/GEMM: {timings})")
        chosen[key] = _MEASURED[(name, key)]
    if lines:
        logger.info(
            "Measured the kernel/GEMM crossovers on %s in %.1f s:\n  %s",
            name,
            time.perf_counter() - start,
            "\n  ".join(lines),
        )
    return chosen


def set_kernel_rows(model: nn.Module, rows: int) -> int:
    """Every two-route method of `model` takes its kernel up to `rows` rows (benchmarks
    comparing the routes; recapture CUDA graphs after); returns how many changed."""
    methods = [m for group in two_route_methods(model).values() for m in group]
    for method in methods:
        method.max_kernel_rows = rows
    return len(methods)
