"""FP8 projections against bf16 on Llama-3.1-8B's shapes, in CUDA graphs (device time).

    python benchmarks/gpu/fp8_gemm.py
    python benchmarks/gpu/fp8_gemm.py --rows 1 200 --iters 20

Per projection shape (q|k|v 6144x4096, gate|up 28672x4096, down 4096x14336) and row count:
`F.linear` on the bf16 weight, `fp8_linear` (engine/layers/fp8_linear.py: per-token
quantization of the activations plus one row-wise `torch._scaled_mm`), and the per-token
quantization alone, each captured `--iters` times in one CUDA graph and replayed (launch
costs out, as in the engine's graphed decode steps); and the FP8 result's largest error
against the float64 product of the same FP8 operands, relative to its largest value.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch
import torch.nn.functional as F

from engine.layers.fp8_linear import (
    fp8_linear,
    quantize_per_token,
    quantize_weight_per_row,
    scaled_mm_reference,
)

SHAPES = ((6144, 4096), (28672, 4096), (4096, 14336))  # (out, in) of Llama-3.1-8B's layers


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 200, 2048])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    device = torch.device("cuda")
    print(torch.__version__, torch.cuda.get_device_name(device))
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
