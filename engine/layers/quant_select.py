"""Quantized CPU linear layers: the fp32 route or the int8 route per row bucket, by measurement.

A layer kept quantized (engine/layers/quantization.py) computes in fp32 by default: the
native kernels dequantize its blocks and multiply fp32 activations (`quant_linear`). For
Q4_0 / Q4_1 / Q8_0 blocks on x86 there is a second route, `quant_linear_int8`: the
activations quantized per 32-value block to int8 and integer dot products against the
blocks (AVX-512 VNNI, else AVX2), as the greedy screen does for the LM head. It does fewer
instructions per product but unpacks the weight on every call, so it can only pay on
batched steps, and how many rows it takes depends on the CPU and the shape. So, as
engine/layers/linear_select.py does for fp32 weights, both routes are timed once per
(block type, shape) and row bucket (`ROW_BUCKETS`, from 2 rows: batch-1 steps keep the
fp32 GEMV and the whole-step decode) on the real weight at start-up, and int8 is kept only
where it is faster. Before timing, the int8 result is checked against the fp32 route on
that weight: it must agree within the activations' 8-bit rounding (`INT8_TOLERANCE`), else
the route is not a candidate.

The int8 route changes the numbers (not only their summation order): its effect on the
default model is tested end to end by DESIGN.md's top-5 criterion
(tests/engine/models/test_int8_route.py). The decisions are cached beside the fp32 ones,
under the same key (CPU, ISA flags and limits, torch, threads). ``$PAGEDSERVE_QUANT_ROUTE``
(`fp32`, `int8`, `auto`) forces one route wherever it applies, or (`auto`) lets the trial
choose; unset, it is fp32 (`DEFAULT_ROUTE`: the int8 route is opt-in until its effect on
small models' answers is understood).
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
from torch import nn

from engine.layers.linear_select import _time_round_robin
from engine.layers.method_cache import cache_file, cache_key, read_cache, write_cache
from engine.layers.quantization import CPUQuantizedLinearMethod
from engine.layers.row_buckets import BUCKET_ROWS, ROW_BUCKETS
from engine.native import native_kernels_available
from engine.native.quant import QuantizedWeight, quant_linear
from engine.native.quant_int8 import int8_applies, quant_linear_int8

logger = logging.getLogger(__name__)

QUANT_ROUTE_ENV = "PAGEDSERVE_QUANT_ROUTE"
# Off by default for now: on the default model (SmolLM2-135M, Q4_1) the int8 route flips the
# first token of the README's greedy chat answer (a top-5 neighbour: "L'Étoile" for "Paris"),
# which the top-5 criterion allows but a user would not. `auto` runs the trial below.
DEFAULT_ROUTE = "fp32"
ROUTES = ("fp32", "int8")
INT8_MIN_ROWS = 2  # batch-1 steps: the fp32 GEMV (and the whole-step decode) stay
# The int8 route's largest error against the fp32 route, relative to the largest output, on
# the trial's random activations (measured: ~0.5 %; a wrong decode is off by ~100 %).
INT8_TOLERANCE = 0.03
# int8 must beat fp32 by this factor to be kept: a tie on a noisy machine stays fp32.
_MARGIN = 0.97


def forced_route() -> str | None:
    """$PAGEDSERVE_QUANT_ROUTE (unset: fp32), or None for `auto` (the timed trial);
    ValueError on an unknown name."""
    value = os.environ.get(QUANT_ROUTE_ENV, "").strip().lower() or DEFAULT_ROUTE
    if value == "auto":
        return None
    if value not in ROUTES:
        raise ValueError(f"${QUANT_ROUTE_ENV} must be auto, fp32 or int8: {value!r}")
    return value


def route_applies(bucket: int) -> bool:
    lo, _ = ROW_BUCKETS[bucket]
    return lo >= INT8_MIN_ROWS


def forced_routes(route: str) -> tuple[str, ...]:
    return tuple(route if route_applies(b) else "fp32" for b in range(len(ROW_BUCKETS)))


def _int8_agrees(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    expected = quant_linear(x, weight)
    actual = quant_linear_int8(x, weight)
    error = (actual - expected).abs().max().item()
    if not error <= INT8_TOLERANCE * expected.abs().max().item():
        logger.warning(
            "int8 route off by %.3g on a %s weight; not a candidate.", error, weight.qtype.name
        )
        return False
    return True


def time_routes(weight: QuantizedWeight) -> list[dict[str, float]]:
    """Per row bucket, seconds per call of each route that applies (int8 only where it
    agrees with fp32 on this weight)."""
    generator = torch.Generator().manual_seed(0)
    table = []
    for bucket, rows in enumerate(BUCKET_ROWS):
        x = torch.randn(rows, weight.in_features, generator=generator)
        calls = {"fp32": functools.partial(quant_linear, x, weight)}
        if route_applies(bucket) and _int8_agrees(x, weight):
            calls["int8"] = functools.partial(quant_linear_int8, x, weight)
        table.append(_time_round_robin(calls))
    return table


def choose_routes(table: list[dict[str, float]]) -> tuple[str, ...]:
    """int8 where it was timed and beat fp32 by `_MARGIN`, else fp32."""
    return tuple(
        "int8" if times.get("int8", float("inf")) < _MARGIN * times["fp32"] else "fp32"
        for times in table
    )


def _shape_name(weight: QuantizedWeight) -> str:
    return f"{weight.qtype.name}:{weight.out_features}x{weight.in_features}"


def select_routes(weights: list[QuantizedWeight]) -> dict[str, tuple[str, ...]]:
    """The route per row bucket for each distinct (type, shape) among `weights` that can take
    the int8 route here: forced, else cached, else measured (and the cache updated)."""
    shapes = {_shape_name(w): w for w in weights if int8_applies(w)}
    if not shapes:
        return {}
    forced = forced_route()
    if forced is not None:
        return {name: forced_routes(forced) for name in shapes}
    key = {**cache_key(), "quantized_routes": list(ROUTES)}
    path = cache_file(key)
    cached = read_cache(path, key, names=ROUTES, label="quantized-route")
    result, measured = {}, False
    start = time.perf_counter()
    for name, weight in shapes.items():
        if name not in cached:
            cached[name] = choose_routes(time_routes(weight))
            measured = True
        result[name] = cached[name]
    if measured:
        write_cache(path, key, cached)
        logger.info(
            "Timed the int8 route of %d quantized shapes in %.1f s (cache: %s).",
            len(shapes),
            time.perf_counter() - start,
            path,
        )
    return result


def plan_quantized_routes(model: nn.Module) -> int:
    """Gives every CPU-quantized layer part that can take the int8 route its route per row
    bucket; returns how many parts take int8 in some bucket."""
    if not native_kernels_available():
        return 0
    methods = [
        m.quant_method
        for m in model.modules()
        if isinstance(getattr(m, "quant_method", None), CPUQuantizedLinearMethod)
    ]
    routes = select_routes([part for method in methods for part in method.parts])
    count = 0
    for method in methods:
        chosen = [routes.get(_shape_name(part)) for part in method.parts]
        method.set_routes(chosen)
        count += sum(r is not None and "int8" in r for r in chosen)
    return count
