"""Block-scaled FP8 projections (128 x 128 blocks) against bf16 on Llama-3.1-8B's shapes.

    python benchmarks/gpu/fp8_block_gemm.py                       # rows 1 16 64 256
    python benchmarks/gpu/fp8_block_gemm.py --rows 1 200 --iters 20 --output-json b.json
    python benchmarks/gpu/fp8_block_gemm.py --smoke               # the wiring, on a CPU

Per projection shape (q|k|v 6144x4096, o 4096x4096, gate|up 28672x4096, down 4096x14336)
and row count: `F.linear` on the bf16 weight and the W8A16 block GEMM of
kernels/fp8_block_gemm.py (autotuned; what a block FP8 checkpoint's layers run on CUDA),
each captured `--iters` times in one CUDA graph and replayed (launch costs out, as in the
engine's graphed decode steps): microseconds, GB/s of the bytes each must read (weights,
scales, activations, output) and their share of the copy bandwidth; and the block GEMM's
largest error against the float64 product of the same operands, relative to its largest
value. `--smoke` runs tiny shapes through Triton's interpreter with wall-clock timing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])
if "--smoke" in sys.argv:  # before any kernel module is imported: Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

from benchmarks.gpu.fp8_gemm import SHAPES, graphed_us
from benchmarks.gpu.roofline import copy_bandwidth_gbps

BLOCK = (128, 128)
SMOKE_SHAPES = ((160, 200), (96, 136))


def quantize_blocks(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:  # fp8 [N, K], fp32 [ceil(N/rows), ceil(K/cols)]
    """A random weight as block FP8: scale = block amax / 448 (ragged edges padded)."""
    rows, cols = block
    n, k = weight.shape
    nb, kb = -(-n // rows), -(-k // cols)
    padded = torch.zeros(nb * rows, kb * cols, device=weight.device, dtype=torch.float32)
    padded[:n, :k] = weight
    blocks = padded.view(nb, rows, kb, cols)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)  # [nb, kb]
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).view_as(padded)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def wall_us(fn, iters: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def measure(shape, rows, args, device, copy_gbps) -> dict:
    from kernels.fp8_block_gemm import fp8_block_gemm, ref_fp8_block_gemm

    out_features, in_features = shape
    dtype = torch.float32 if args.smoke else torch.bfloat16
    generator = torch.Generator(device=device).manual_seed(out_features + rows)
    weight = torch.randn(shape, device=device, generator=generator) * 0.02
    w_q, scale = quantize_blocks(weight, BLOCK)
    weight = weight.to(dtype)
    x = torch.randn(rows, in_features, device=device, dtype=dtype, generator=generator)
    exact = ref_fp8_block_gemm(x, w_q, scale, BLOCK)
    error = (fp8_block_gemm(x, w_q, scale, BLOCK).double() - exact).abs().max()
    timer = wall_us if args.smoke else graphed_us
    bf16 = timer(lambda: F.linear(x, weight), args.iters)
    block = timer(lambda: fp8_block_gemm(x, w_q, scale, BLOCK), args.iters)
    act = x.element_size() * rows * (in_features + out_features)
    bytes_bf16 = weight.numel() * weight.element_size() + act
    bytes_block = w_q.numel() + 4 * scale.numel() + act
    result = {
        "rows": rows, "out": out_features, "in": in_features, "bf16_us": bf16,
        "block_fp8_us": block, "bf16_gbps": bytes_bf16 / bf16 / 1e3,
        "block_fp8_gbps": bytes_block / block / 1e3,
        "error": float(error / exact.abs().max()),
    }  # fmt: skip
    result["block_fp8_share"] = result["block_fp8_gbps"] / copy_gbps
    result["bf16_share"] = result["bf16_gbps"] / copy_gbps
    print(
        f"{rows:5d} x {out_features:5d} x {in_features:5d}: bf16 {bf16:8.1f} us "
        f"({result['bf16_share']:4.0%} of copy), block fp8 {block:8.1f} us "
        f"({result['block_fp8_gbps']:6.0f} GB/s, {result['block_fp8_share']:4.0%} of copy, "
        f"{bf16 / block:.2f}x bf16); error {result['error']:.1e}",
        flush=True,
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        print("needs a CUDA device (or --smoke)")
        return 1
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        args.iters = min(args.iters, 2)
    print(torch.__version__, torch.cuda.get_device_name(device) if not args.smoke else "CPU")
    copy_gbps = copy_bandwidth_gbps(device, (2 << 30) if device.type == "cuda" else 64 << 20)
    print(f"copy bandwidth (read + write): {copy_gbps:.0f} GB/s; blocks {list(BLOCK)}")
    results = {"copy_gbps": copy_gbps, "block": list(BLOCK), "rows": []}
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:
        for rows in args.rows:
            results["rows"].append(measure(shape, rows, args, device, copy_gbps))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
