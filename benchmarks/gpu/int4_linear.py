"""Where the INT4 layer should switch from the in-kernel dequantization to dequantize-then-
cuBLAS: both routes of `Int4LinearMethod` timed per row count on Llama-3.1-8B's projection
shapes, beside the bf16 `F.linear` of the same shape.

    python benchmarks/gpu/int4_linear.py                       # rows 1 .. 4096
    python benchmarks/gpu/int4_linear.py --rows 1 16 64 256

Prints, per shape and row count, microseconds per call of `int4_gemm`, of `int4_dequantize`
+ matmul, and of bf16; the smallest row count where the second beats the first is the
crossover `engine/layers/int4_linear.py`'s `INT4_GEMM_MAX_ROWS` should take. CUDA only:
without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

# (in, out) of Llama-3.1-8B's fused projections: q|k|v, o, gate|up, down
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def _time_us(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _dequantize_then_matmul(x, qweight, scales, zeros, group_size):
    from kernels.int4_gemm import int4_dequantize

    return x @ int4_dequantize(qweight, scales, zeros, group_size, x.dtype)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 256, 512, 4096]
    )
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    from kernels.int4_gemm import int4_gemm

    dev = torch.device("cuda")
    group = args.group_size
    for name, (k, n) in SHAPES.items():
        qweight = torch.randint(-(2**31), 2**31, (k // 8, n), dtype=torch.int32, device=dev)
        groups = k // group
        scales = (torch.rand(groups, n, device=dev) * 0.004 + 0.002).half()
        zeros = torch.full((groups, n), 8.0, device=dev).half()
        weight = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        crossover = None
        for rows in args.rows:
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            fused = _time_us(functools.partial(int4_gemm, x, qweight, scales, zeros, group))
            split = _time_us(
                functools.partial(_dequantize_then_matmul, x, qweight, scales, zeros, group)
            )
            dense = _time_us(functools.partial(torch.nn.functional.linear, x, weight))
            if crossover is None and split < fused:
                crossover = rows
            print(
                f"{name:>7} {k}x{n} rows {rows:5d}: int4_gemm {fused:9.1f} us, dequantize + "
                f"matmul {split:9.1f} us, bf16 {dense:9.1f} us",
                flush=True,
            )
        print(f"{name}: dequantize + matmul first wins at {crossover} rows", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
