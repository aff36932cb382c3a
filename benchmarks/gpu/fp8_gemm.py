"""FP8 projections against bf16 on Llama-3.1-8B's shapes, in CUDA graphs (device time).

    python benchmarks/gpu/fp8_gemm.py                        # both parts
    python benchmarks/gpu/fp8_gemm.py --part linear --rows 1 200 --iters 20
    python benchmarks/gpu/fp8_gemm.py --part routes --output-json fp8_routes.json
    python benchmarks/gpu/fp8_gemm.py --part routes --smoke  # the wiring, on a CPU

`linear`: per projection shape (q|k|v 6144x4096, o 4096x4096, gate|up 28672x4096, down
4096x14336) and row count: `F.linear` on the bf16 weight, `fp8_linear`
(engine/layers/fp8_linear.py: per-token quantization of the activations plus one row-wise
`torch._scaled_mm`), and the per-token quantization alone, each captured `--iters` times in
one CUDA graph and replayed (launch costs out, as in the engine's graphed decode steps); and
the FP8 result's largest error against the float64 product of the same FP8 operands,
relative to its largest value.

`routes`: the FP8 layer's two routes per row count (1 .. 128): the GEMV of
kernels/fp8_gemv.py against quantize + `_scaled_mm`, as the engine's crossover calibration
times them (benchmarks/gpu/route_timing.py): microseconds, GB/s and share of the copy
bandwidth per route, and the crossover per shape the engine would pick.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])
if "--smoke" in sys.argv:  # before any kernel module is imported: Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

from benchmarks.gpu.roofline import copy_bandwidth_gbps
from benchmarks.gpu.route_timing import ROWS, num_copies, sweep, timer_for
from engine.layers.fp8_linear import (
    Fp8LinearMethod,
    fp8_gemv_kernel,
    fp8_linear,
    quantize_per_token,
    quantize_weight_per_row,
    scaled_mm_reference,
)

# (out, in) of Llama-3.1-8B's layers: q|k|v, o, gate|up, down
SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
SMOKE_SHAPES = ((48, 64), (40, 96))


def graphed_us(fn: Callable[[], object], iters: int) -> float:
    """Microseconds per call of `fn`, `iters` calls captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (10 * iters) * 1e6


def part_linear(args: argparse.Namespace, device: torch.device) -> None:
    for out_features, in_features in SHAPES:
        weight = torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16)
        w_q, w_scale = quantize_weight_per_row(weight * 0.02)
        for rows in args.rows:
            x = torch.randn(rows, in_features, device=device, dtype=torch.bfloat16)
            q_x, s_x = quantize_per_token(x)
            exact = scaled_mm_reference(
                q_x, w_q.t(), scale_a=s_x, scale_b=w_scale[None], out_dtype=torch.float64
            )
            error = (fp8_linear(x, w_q, w_scale).double() - exact).abs().max()
            bf16 = graphed_us(lambda: F.linear(x, weight), args.iters)  # noqa: B023
            fp8 = graphed_us(lambda: fp8_linear(x, w_q, w_scale), args.iters)  # noqa: B023
            quant = graphed_us(lambda: quantize_per_token(x), args.iters)  # noqa: B023
            print(
                f"{rows:5d} x {out_features:5d} x {in_features:5d}: bf16 {bf16:7.1f} us, "
                f"fp8 {fp8:7.1f} us ({bf16 / fp8:.2f}x), of which the per-token quantization "
                f"{quant:6.1f} us; error {error / exact.abs().max():.1e}",
                flush=True,
            )


def part_routes(args: argparse.Namespace, device: torch.device) -> dict:
    """The GEMV against `_scaled_mm` per row count and shape, and the crossovers."""
    dtype = torch.float32 if args.smoke else torch.bfloat16
    copy_gbps = copy_bandwidth_gbps(device, (2 << 30) if device.type == "cuda" else 64 << 20)
    print(f"copy bandwidth (read + write): {copy_gbps:.0f} GB/s", flush=True)
    rows = tuple(args.route_rows)
    results = {"copy_gbps": copy_gbps, "shapes": {}}
    gemv = fp8_gemv_kernel(triton=True)
    for out_features, in_features in SMOKE_SHAPES if args.smoke else SHAPES:
        generator = torch.Generator(device=device).manual_seed(out_features)
        weight = torch.randn(out_features, in_features, device=device, generator=generator)
        w_q, w_scale = quantize_weight_per_row(weight * 0.02)
        del weight
        layer_bytes = w_q.numel() + 4 * out_features  # FP8 codes, fp32 scales
        methods = []
        for _ in range(num_copies(layer_bytes, device)):
            layer = torch.nn.Module()
            layer.weight, layer.weight_scale = w_q.clone(), w_scale.clone()
            methods.append(Fp8LinearMethod(layer, gemv=gemv))
        name = f"fp8 {out_features}x{in_features}"
        results["shapes"][name] = sweep(
            name, methods, layer_bytes, out_features, rows, dtype, device, copy_gbps,
            timer_for(device),
        )  # fmt: skip
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["linear", "routes", "all"], default="all")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 200, 2048])
    parser.add_argument("--route-rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        print("needs a CUDA device (or --smoke)")
        return 1
    device = torch.device("cpu" if args.smoke else "cuda")
    print(torch.__version__, torch.cuda.get_device_name(device) if not args.smoke else "CPU")
    results = {}
    if args.part in ("linear", "all") and not args.smoke:
        part_linear(args, device)
    if args.part in ("routes", "all"):
        results["routes"] = part_routes(args, device)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
