"""The kernel/GEMM crossover (engine/layers/crossover.py) driven by a table of times in
place of CUDA events, over real two-route layers (FP8 GEMV vs `_scaled_mm`, INT4
dequantize-GEMM vs dequantize-then-matmul) whose kernels run in Triton's interpreter:
the choice per shape, timing stopped where the GEMM wins, one measurement per shape, the
environment's settings, and a fixed route per row count once graphs would be captured."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.layers import crossover
from engine.layers.crossover import (
    KERNEL_ROWS_ENV,
    Trial,
    choose_crossover,
    kernel_rows_setting,
    plan_crossovers,
    set_kernel_rows,
    two_route_methods,
)
from engine.layers.fp8_linear import (
    FP8_GEMV_MAX_ROWS,
    Fp8LinearMethod,
    fp8_gemv_kernel,
    quantize_weight_per_row,
)
from engine.layers.int4_linear import INT4_GEMM_MAX_ROWS, Int4LinearMethod
from engine.loader.int4_packing import Int4Weight
from tests.kernels._helpers import requires_cuda
from tests.triton_utils import import_triton

import_triton()

CPU = torch.device("cpu")
ROWS = (1, 2, 4, 8)


@pytest.fixture(autouse=True)
def fresh_process_cache(monkeypatch):
    monkeypatch.setattr(crossover, "_MEASURED", {})
    monkeypatch.delenv(KERNEL_ROWS_ENV, raising=False)


class Spy:
    """Wraps a route's callable and records the row count of each call."""

    def __init__(self, fn):
        self.fn, self.rows = fn, []

    def __call__(self, x, *args, **kwargs):
        self.rows.append(x.shape[0])
        return self.fn(x, *args, **kwargs)


def _fp8_layer(n: int, k: int, seed: int) -> tuple[nn.Module, Spy, Spy]:
    layer = nn.Module()
    gen = torch.Generator().manual_seed(seed)
    layer.weight, layer.weight_scale = quantize_weight_per_row(torch.randn(n, k, generator=gen))
    gemv, scaled_mm = Spy(fp8_gemv_kernel(triton=True)), Spy(torch._scaled_mm)
    layer.quant_method = Fp8LinearMethod(layer, scaled_mm, gemv=gemv)
    return layer, gemv, scaled_mm


def _int4_layer(k: int, n: int, group_size: int) -> nn.Module:
    gen = torch.Generator().manual_seed(k + n)
    qweight = torch.randint(-(2**31), 2**31, (k // 8, n), generator=gen, dtype=torch.int32)
    scales = torch.rand(k // group_size, n, generator=gen) * 0.02 + 0.005
    zeros = torch.full((k // group_size, n), 8.0)
    layer = nn.Module()
    layer.quant_method = Int4LinearMethod([Int4Weight(qweight, scales, zeros, group_size, None)])
    return layer


def _model():
    """Two FP8 layers of one shape, one of another, one INT4 layer."""
    model = nn.Module()
    model.a = _fp8_layer(24, 64, 0)[0]
    model.b = _fp8_layer(24, 64, 1)[0]
    model.c = _fp8_layer(40, 32, 2)[0]
    model.d = _int4_layer(64, 32, 32)
    return model


class TableTimer:
    """Times from a table {(key prefix, route): {rows: seconds}}; runs each call once (the
    routes must run) and records what it was asked."""

    def __init__(self, table):
        self.table, self.trials = table, []

    def __call__(self, trial: Trial) -> float:
        trial.call()
        self.trials.append((trial.key, trial.route, trial.rows, trial.num_layers))
        for (prefix, route), times in self.table.items():
            if trial.key.startswith(prefix) and trial.route == route:
                return times[trial.rows]
        raise KeyError(trial.key)


TABLE = {
    # FP8 24x64: the GEMV wins up to 4 rows, loses at 8
    ("fp8 24x64", "kernel"): {1: 1.0, 2: 1.1, 4: 1.5, 8: 3.0},
    ("fp8 24x64", "gemm"): {1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0},
    # FP8 40x32: the GEMV loses at once
    ("fp8 40x32", "kernel"): {1: 5.0, 2: 5.0, 4: 5.0, 8: 5.0},
    ("fp8 40x32", "gemm"): {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0},
    # INT4: the kernel wins at every measured row count (ties go to the kernel)
    ("int4", "kernel"): {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0},
    ("int4", "gemm"): {1: 1.0, 2: 4.0, 4: 4.0, 8: 4.0},
}


def test_choose_crossover_is_the_prefix_the_kernel_wins() -> None:
    assert choose_crossover([(1, 1.0, 2.0), (4, 1.9, 2.0), (16, 2.1, 2.0), (64, 1.0, 9.0)]) == 4
    assert choose_crossover([(1, 3.0, 2.0), (4, 1.0, 2.0)]) == 0  # no later win counts
    assert choose_crossover([(1, 1.0, 1.0), (2, 1.0, 1.0)]) == 2  # a tie keeps the kernel
    assert choose_crossover([]) == 0


def test_plan_measures_each_shape_and_sets_every_layer() -> None:
    model = _model()
    timer = TableTimer(TABLE)
    chosen = plan_crossovers(model, torch.float32, CPU, timer=timer, rows=ROWS)
    assert chosen == {"fp8 24x64": 4, "fp8 40x32": 0, "int4 32x64 g32": 8}
    assert model.a.quant_method.max_kernel_rows == model.b.quant_method.max_kernel_rows == 4
    assert model.c.quant_method.max_kernel_rows == 0
    assert model.d.quant_method.max_kernel_rows == 8
    # each shape timed at every row count until the GEMM first won, both routes, and the
    # two layers of a shape in one call (their weights rotate through the cache)
    asked = {(key, rows) for key, _, rows, _ in timer.trials}
    assert {r for k, r in asked if k == "fp8 24x64"} == {1, 2, 4, 8}
    assert {r for k, r in asked if k == "fp8 40x32"} == {1}
    assert {r for k, r in asked if k.startswith("int4")} == set(ROWS)
    assert {n for k, _, _, n in timer.trials if k == "fp8 24x64"} == {2}
    assert len(timer.trials) == 2 * len(asked)


def test_the_trials_run_the_route_they_name() -> None:
    model = nn.Module()
    model.a, gemv, scaled_mm = _fp8_layer(24, 64, 0)
    plan_crossovers(model, torch.float32, CPU, timer=TableTimer(TABLE), rows=(1, 2))
    assert gemv.rows == [1, 2] and scaled_mm.rows == [1, 2]


def test_a_shape_is_measured_once_per_process() -> None:
    """A second plan (another model of the same shapes, a wake-up) reuses the crossovers:
    a new table would say otherwise, and is never asked."""
    plan_crossovers(_model(), torch.float32, CPU, timer=TableTimer(TABLE), rows=ROWS)
    flipped = {key: {r: 10.0 - t for r, t in times.items()} for key, times in TABLE.items()}
    timer = TableTimer(flipped)
    model = _model()
    chosen = plan_crossovers(model, torch.float32, CPU, timer=timer, rows=ROWS)
    assert chosen["fp8 24x64"] == 4 and timer.trials == []
    assert model.c.quant_method.max_kernel_rows == 0


def test_the_cpu_and_off_change_nothing(monkeypatch) -> None:
    model = _model()
    assert plan_crossovers(model, torch.float32, CPU) == {}  # no timer: CUDA only
    monkeypatch.setenv(KERNEL_ROWS_ENV, "off")
    assert plan_crossovers(model, torch.float32, CPU, timer=TableTimer({})) == {}
    assert model.a.quant_method.max_kernel_rows == FP8_GEMV_MAX_ROWS
    assert model.d.quant_method.max_kernel_rows == INT4_GEMM_MAX_ROWS
    # a CPU FP8 layer has no GEMV: one route, `_scaled_mm` at every row count
    layer = nn.Module()
    layer.weight, layer.weight_scale = quantize_weight_per_row(torch.randn(16, 32))
    layer.quant_method = Fp8LinearMethod(layer, gemv=fp8_gemv_kernel(triton=False))
    assert layer.quant_method.max_kernel_rows == 0
    assert layer.quant_method.crossover_key() is None
    holder = nn.Module()
    holder.layer = layer
    assert two_route_methods(holder) == {}


def test_a_forced_row_count_times_nothing(monkeypatch) -> None:
    monkeypatch.setenv(KERNEL_ROWS_ENV, "3")
    model = _model()
    timer = TableTimer({})
    assert set(plan_crossovers(model, torch.float32, CPU, timer=timer).values()) == {3}
    assert timer.trials == [] and model.d.quant_method.max_kernel_rows == 3
    assert set_kernel_rows(model, 0) == 4 and model.a.quant_method.max_kernel_rows == 0


@pytest.mark.parametrize("value", ["-1", "many", "1.5"])
def test_a_bad_setting_names_the_variable(monkeypatch, value) -> None:
    monkeypatch.setenv(KERNEL_ROWS_ENV, value)
    with pytest.raises(ValueError, match=KERNEL_ROWS_ENV):
        kernel_rows_setting()


def test_graph_capture_sees_a_fixed_route_per_row_count(monkeypatch) -> None:
    """After the plan, every capture size takes one route, the same on every call (what a
    graph bakes in), rows <= the crossover the GEMV; the plan refuses to run mid-capture."""
    model = nn.Module()
    model.a, gemv, scaled_mm = _fp8_layer(24, 64, 0)
    plan_crossovers(model, torch.float32, CPU, timer=TableTimer(TABLE), rows=ROWS)
    gemv.rows.clear()
    scaled_mm.rows.clear()
    method = model.a.quant_method
    sizes = [1, 2, 3, 4, 5, 8, 16]
    for _ in range(2):  # the capture's eager run, then the captured call
        for size in sizes:
            method.apply(torch.randn(size, 64), None)
    assert gemv.rows == [s for s in sizes if s <= 4] * 2
    assert scaled_mm.rows == [s for s in sizes if s > 4] * 2
    monkeypatch.setattr(crossover, "_capturing", lambda: True)
    monkeypatch.setattr(crossover, "_MEASURED", {})
    with pytest.raises(RuntimeError, match="before CUDA graph capture"):
        plan_crossovers(model, torch.float32, CPU, timer=TableTimer(TABLE), rows=ROWS)
    assert method.max_kernel_rows == 4


def test_a_failing_route_ends_the_measurement_without_stopping_the_load() -> None:
    """A route that raises (a kernel that does not compile there, memory) at 4 rows: the
    rows measured before decide; at the first row count: the GEMM everywhere."""

    def timer_failing_at(rows: int, route: str):
        table = TableTimer(TABLE)

        def timer(trial: Trial) -> float:
            if trial.rows == rows and trial.route == route:
                raise RuntimeError("no kernel here")
            return table(trial)

        return timer

    model = nn.Module()
    model.a = _fp8_layer(24, 64, 0)[0]
    chosen = plan_crossovers(model, torch.float32, CPU, timer_failing_at(4, "gemm"), ROWS)
    assert chosen == {"fp8 24x64": 2}
    crossover._MEASURED.clear()
    chosen = plan_crossovers(model, torch.float32, CPU, timer_failing_at(1, "kernel"), ROWS)
    assert chosen == {"fp8 24x64": 0} and model.a.quant_method.max_kernel_rows == 0


@requires_cuda
def test_on_a_gpu_the_measured_route_replays_in_a_graph() -> None:
    """The real timer (CUDA graphs and events) on an 8B-sized FP8 shape: a crossover among
    the measured row counts, and a graph captured after it replays the eager result."""
    cuda = torch.device("cuda")
    model = nn.Module()
    for i in range(2):
        layer = nn.Module()
        weight = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(i)) * 0.02
        layer.weight, layer.weight_scale = (t.to(cuda) for t in quantize_weight_per_row(weight))
        layer.quant_method = Fp8LinearMethod(layer, gemv=fp8_gemv_kernel(triton=True))
        setattr(model, f"l{i}", layer)
    rows = (1, 2, 4, 8, 16, 32)
    chosen = plan_crossovers(model, torch.bfloat16, cuda, rows=rows)
    assert chosen["fp8 4096x4096"] in (0, *rows)
    method = model.l0.quant_method
    for size in (1, 4, 64):
        x = torch.randn(size, 4096, device=cuda, dtype=torch.bfloat16)
        eager = method.apply(x, None)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = method.apply(x, None)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
