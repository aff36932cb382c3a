"""fp32 CPU linear layers: the fastest of several GEMM implementations, chosen by measurement.

Which library multiplies a [rows, K] activation by a [N, K] weight fastest depends on the
CPU, the torch build, the thread count, the shape and, most of all, the row count: MKL's
packed GEMM wins on long prefill chunks, a plain GEMV or our own kernel at one decode row.
So for each distinct weight shape and each row-count bucket (`ROW_BUCKETS`) the candidates

- ``mkl_packed``: `cblas_sgemm_compute` on a `cblas_sgemm_pack`-ed copy (torch.ops.mkl),
- ``onednn``:     oneDNN's inner product on a reordered copy (torch.ops.mkldnn),
- ``torch``:      plain `F.linear` (MKL sgemm re-packing the weight on every call),
- ``native``:     ours on the fp32 rows, read in place (no copy): the GEMV of
                  engine/native/quant_kernels.c up to 8 rows, the tiled GEMM of
                  engine/native/quant_gemm.c from 33 rows (not in between, where 16-row
                  tiles would be half padding),

are timed once on the real weight at start-up and the fastest is kept. bf16 weights (a bf16
engine: `dtype="auto"` on a CPU with AMX-BF16 or AVX512-BF16, or asked for) have their own
trial among the methods that take bf16 (`BF16_METHODS`: oneDNN's reordered weight, which
runs on AMX where the CPU has it, and torch's bf16 matmul, oneDNN underneath too), keyed
apart from the fp32 shapes. Every candidate is
first checked against `F.linear` on that weight (one that disagrees is dropped). Only methods
that won somewhere get a prepared copy of the weight (the packed/reordered copies are as
large as the weight, and the default model should fit under 1 GB).

The decisions are cached as JSON under the model cache root (`linear_methods/`), keyed by
CPU model, ISA flags (and any ISA limit set in the environment), torch version and thread
count, so later starts read them and time nothing (engine/layers/method_cache.py; the row
buckets: engine/layers/row_buckets.py). ``$PAGEDSERVE_LINEAR_METHOD``
(`mkl_packed`, `onednn`, `torch`, `native`, `auto`) forces one method for every bucket it
can run (tests, benchmarks).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from engine.layers.method_cache import cache_file, cache_key, read_cache, write_cache
from engine.layers.row_buckets import BUCKET_OF, BUCKET_ROWS, ROW_BUCKETS
from engine.native import native_kernels_available
from engine.native.quant import fp32_weight, quant_linear

logger = logging.getLogger(__name__)

LINEAR_METHOD_ENV = "PAGEDSERVE_LINEAR_METHOD"
METHODS = ("mkl_packed", "onednn", "torch", "native")
BF16_METHODS = ("onednn", "torch")  # MKL's packed GEMM and our kernels take fp32 only
# Methods that keep their own copy of the weight (as large as the weight itself).
_COPYING = ("mkl_packed", "onednn")
# A weight copy must earn its memory: it is kept only if it saves, summed over the buckets,
# more than this fraction of one bucket's best time.
_COPY_PENALTY = 0.1
_NATIVE_MAX_ROWS = 8  # our GEMV reads each weight row once for all rows: few rows only
_NATIVE_GEMM_MIN_ROWS = 33  # our GEMM's 16-row tiles are well filled from here on
# Timing one (shape, bucket): at least _MIN_ROUNDS calls of each method, then more rounds
# until this many seconds have passed (the default model's 4 shapes: about 1 s when idle;
# a 2-core machine loaded 4x over took ~10 s).
_TIME_BUDGET_S = 0.03
_MIN_ROUNDS, _MAX_ROUNDS = 3, 50
Prepared = Any  # a method's copy of the weight (None when it uses the weight itself)
RunFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", Prepared], torch.Tensor]


def _run_mkl(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, p: Prepared) -> torch.Tensor:
    return torch.ops.mkl._mkl_linear(x, p, w, b, x.shape[0])


def _run_onednn(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, p: Prepared
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")


def _run_torch(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, p: Prepared
) -> torch.Tensor:
    return F.linear(x, w, b)


def _run_native(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, p: Prepared
) -> torch.Tensor:
    return quant_linear(x, p, b)


def _prepare(method: str, weight: torch.Tensor) -> Prepared:
    """The method's own copy (or view) of an fp32 [N, K] weight."""
    weight = weight.detach()
    if method == "mkl_packed":
        return torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), 64)
    if method == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)
    if method == "native":
        return fp32_weight(weight)
    return None


_RUN: dict[str, RunFn] = {
    "mkl_packed": _run_mkl,
    "onednn": _run_onednn,
    "torch": _run_torch,
    "native": _run_native,
}


def method_available(method: str) -> bool:
    """Whether this torch build (and machine) can run `method` at all."""
    if method == "mkl_packed":
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    if method == "onednn":
        return torch.backends.mkldnn.is_available() and hasattr(
            torch.ops.mkldnn, "_linear_pointwise"
        )
    if method == "native":
        return native_kernels_available()
    return method == "torch"


def applies(method: str, bucket: int) -> bool:
    lo, hi = ROW_BUCKETS[bucket]
    if method != "native":
        return True
    return (hi is not None and hi <= _NATIVE_MAX_ROWS) or lo >= _NATIVE_GEMM_MIN_ROWS


@dataclass
class LinearPlan:
    """One layer's method per row bucket, with the prepared weight copies they use."""

    methods: tuple[str, ...]  # one name per ROW_BUCKETS entry
    prepared: dict[str, Prepared] = field(default_factory=dict)
    _calls: list[tuple[RunFn, Prepared]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if len(self.methods) != len(ROW_BUCKETS):
            raise ValueError(
                f"methods: one per row bucket ({len(ROW_BUCKETS)}), got {self.methods}"
            )
        self._calls = [(_RUN[m], self.prepared.get(m)) for m in self.methods]

    def __call__(
        self,
        x: torch.Tensor,  # [rows, in_features], rows >= 1
        weight: torch.Tensor,  # [out_features, in_features]
        bias: torch.Tensor | None,
    ) -> torch.Tensor:  # [rows, out_features]
        run, prepared = self._calls[BUCKET_OF[min(x.shape[0], 129)]]
        return run(x, weight, bias, prepared)


def forced_method() -> str | None:
    """$PAGEDSERVE_LINEAR_METHOD, or None for `auto`; ValueError on an unknown name or a
    method this build cannot run."""
    value = os.environ.get(LINEAR_METHOD_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in METHODS:
        raise ValueError(f"${LINEAR_METHOD_ENV} must be auto or one of {METHODS}: {value!r}")
    if not method_available(value):
        raise ValueError(f"${LINEAR_METHOD_ENV}={value}: this torch build cannot run it.")
    return value


def forced_methods(method: str, *, dtype: torch.dtype = torch.float32) -> tuple[str, ...]:
    """`method` wherever it applies, `torch` elsewhere (native at 9..32 rows; every bucket
    of a bf16 weight where `method` takes no bf16)."""
    if dtype != torch.float32 and method not in BF16_METHODS:
        method = "torch"
    return tuple(method if applies(method, b) else "torch" for b in range(len(ROW_BUCKETS)))


def measure_methods(weight: torch.Tensor, candidates: tuple[str, ...]) -> tuple[str, ...]:
    """The method per row bucket for `weight` (fp32 [N, K]): the fastest exact candidate,
    with at most one weight copy per layer (`choose_methods`)."""
    return choose_methods(time_methods(weight, candidates))


def time_methods(
    weight: torch.Tensor,  # [N, K] fp32
    candidates: tuple[str, ...],
) -> list[dict[str, float]]:
    """Per row bucket, seconds per call of each candidate that applies and matches
    `F.linear` on this weight."""
    generator = torch.Generator().manual_seed(0)
    prepared = {}
    for method in candidates:
        try:
            prepared[method] = _prepare(method, weight)
        except RuntimeError as error:  # e.g. no bf16 reorder on this CPU
            logger.warning("linear method %s cannot prepare the weight (%s).", method, error)
    candidates = tuple(m for m in candidates if m in prepared)
    table = []
    for bucket, rows in enumerate(BUCKET_ROWS):
        x = torch.randn(rows, weight.shape[1], generator=generator).to(weight.dtype)
        calls = {
            m: functools.partial(_RUN[m], x, weight, None, prepared[m])
            for m in candidates
            if applies(m, bucket) and _is_exact(m, x, weight, prepared[m])
        }
        table.append(_time_round_robin(calls))
    return table


def _is_exact(method: str, x: torch.Tensor, weight: torch.Tensor, prepared: Prepared) -> bool:
    """Whether `method` agrees with `F.linear` up to fp32 rounding (logs why not)."""
    expected = F.linear(x, weight)
    try:
        actual = _RUN[method](x, weight, None, prepared)
    except RuntimeError as error:  # a limited build: not a candidate here
        logger.warning("linear method %s failed (%s); skipped.", method, error)
        return False
    # fp32: rounding only; bf16: the output's own rounding (2^-8) dominates
    tolerance = 1e-4 if weight.dtype == torch.float32 else 2e-2
    difference = (actual.float() - expected.float()).abs().max().item()
    if not difference <= tolerance * (expected.float().abs().max().item() + 1.0):
        logger.warning("linear method %s disagrees with F.linear; skipped.", method)
        return False
    return True


def _time_round_robin(calls: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Best time of each call, the calls taken in turns (at least `_MIN_ROUNDS`, then until
    the budget is spent): on a shared machine a stall then hits one sample of each method,
    not all the samples of one."""
    best = dict.fromkeys(calls, float("inf"))
    deadline = time.perf_counter() + _TIME_BUDGET_S
    for round_index in range(_MAX_ROUNDS):
        for method, call in calls.items():
            start = time.perf_counter()
            call()
            best[method] = min(best[method], time.perf_counter() - start)
        if round_index + 1 >= _MIN_ROUNDS and time.perf_counter() > deadline:
            break
    return best


def choose_methods(table: list[dict[str, float]]) -> tuple[str, ...]:
    """The fastest method per bucket among the ones sharing at most one weight copy:
    for each copy (none, MKL-packed, oneDNN), the sum over buckets of time / best time
    (plus `_COPY_PENALTY` for a copy), and the smallest sum wins (two copies would triple
    the weight memory)."""
    best_plan, best_cost = tuple("torch" for _ in table), float("inf")
    for copy in (None, *_COPYING):
        allowed = {m for m in METHODS if m not in _COPYING or m == copy}
        plan, cost = [], 0.0 if copy is None else _COPY_PENALTY
        for times in table:
            usable = {m: t for m, t in times.items() if m in allowed}
            if not usable:
                plan.append("torch")
                cost += 1.0
                continue
            method = min(usable, key=usable.__getitem__)
            plan.append(method)
            cost += usable[method] / min(times.values())
        if cost < best_cost - 1e-9:
            best_plan, best_cost = tuple(plan), cost
    return best_plan


def select_methods(weights: list[torch.Tensor]) -> dict[tuple[int, int], tuple[str, ...]]:
    """The method per row bucket for each distinct shape among `weights` (fp32 or bf16 CPU
    [N, K]; one dtype per call): forced, else cached, else measured (and the cache
    updated)."""
    shapes = {tuple(w.shape): w for w in weights}
    dtypes = {w.dtype for w in weights}
    if len(dtypes) > 1:
        raise ValueError(f"select_methods takes weights of one dtype, got {dtypes}.")
    dtype = next(iter(dtypes), torch.float32)
    forced = forced_method()
    if forced is not None:
        return {shape: forced_methods(forced, dtype=dtype) for shape in shapes}
    key = cache_key()
    path = cache_file(key)
    cached = read_cache(path, key, names=METHODS)
    usable = METHODS if dtype == torch.float32 else BF16_METHODS
    candidates = tuple(m for m in usable if method_available(m))
    suffix = "" if dtype == torch.float32 else f":{str(dtype).removeprefix('torch.')}"
    result, measured = {}, False
    start = time.perf_counter()
    for shape, weight in shapes.items():
        name = f"{shape[0]}x{shape[1]}{suffix}"
        if name not in cached:
            cached[name] = measure_methods(weight, candidates)
            measured = True
        result[shape] = cached[name]
    if measured:
        write_cache(path, key, cached)
        logger.info(
            "Timed %s linear methods for %d shapes in %.1f s (cache: %s).",
            dtype,
            len(shapes),
            time.perf_counter() - start,
            path,
        )
    return result


def make_plan(weight: torch.Tensor, methods: tuple[str, ...]) -> LinearPlan:
    """A layer's plan with the prepared copies its methods need (one per method)."""
    with torch.no_grad():
        prepared = {m: _prepare(m, weight) for m in set(methods) if m != "torch"}
    return LinearPlan(methods, prepared)
