"""Block-scaled FP8 projections (128 x 128 blocks) against bf16 on Llama-3.1-8B's shapes.

    python benchmarks/gpu/fp8_block_gemm.py            # rows 1 16 64 128 256 1024 4096
    python benchmarks/gpu/fp8_block_gemm.py --rows 1 200 --iters 20 --output-json b.json
    python benchmarks/gpu/fp8_block_gemm.py --smoke    # the wiring, on a CPU

Per projection shape (q|k|v 6144x4096, o 4096x4096, gate|up 28672x4096, down 4096x14336)
and row count: `F.linear` on the bf16 weight, the W8A16 block GEMM of
kernels/fp8_block_gemm.py and (FP8 tensor cores, sm_89+) the W8A8 one of
kernels/fp8_block_w8a8.py with its activation quantization (kernels/fp8_group_quant.py),
the two routes of a block FP8 checkpoint's layers on CUDA (engine/layers/fp8_block_linear.py);
each autotuned, captured `--iters` times in one CUDA graph and replayed (launch costs out, as
in the engine's graphed steps): microseconds, GB/s of the bytes each must read (weights,
scales, activations, output) and their share of the copy bandwidth, TFLOP/s; and each FP8
GEMM's largest error against the float64 product of the unquantized activations and the
dequantized weight, relative to its largest value. Per shape, the first row count at which
W8A8 beat W8A16: what the engine's crossover measurement (engine/layers/crossover.py, up
to 128 rows) should find, and where `BLOCK_FP8_W8A16_MAX_ROWS` should sit. `--smoke` runs
tiny shapes through Triton's interpreter with wall-clock timing.
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


def measure(shape, rows, args, device, copy_gbps, w8a8: bool) -> dict:
    from kernels.fp8_block_gemm import fp8_block_gemm, ref_fp8_block_gemm
    from kernels.fp8_block_w8a8 import fp8_block_w8a8

    out_features, in_features = shape
    dtype = torch.float32 if args.smoke else torch.bfloat16
    generator = torch.Generator(device=device).manual_seed(out_features + rows)
    weight = torch.randn(shape, device=device, generator=generator) * 0.02
    w_q, scale = quantize_blocks(weight, BLOCK)
    weight = weight.to(dtype)
    x = torch.randn(rows, in_features, device=device, dtype=dtype, generator=generator)
    exact = ref_fp8_block_gemm(x, w_q, scale, BLOCK)
    routes = {"block_fp8": fp8_block_gemm, **({"w8a8": fp8_block_w8a8} if w8a8 else {})}
    timer = wall_us if args.smoke else graphed_us
    bf16 = timer(lambda: F.linear(x, weight), args.iters)
    act = x.element_size() * rows * (in_features + out_features)
    flops = 2.0 * rows * in_features * out_features
    bytes_bf16 = weight.numel() * weight.element_size() + act
    result = {
        "rows": rows, "out": out_features, "in": in_features, "bf16_us": bf16,
        "bf16_gbps": bytes_bf16 / bf16 / 1e3, "bf16_tflops": flops / bf16 / 1e6,
    }  # fmt: skip
    result["bf16_share"] = result["bf16_gbps"] / copy_gbps
    line = f"{rows:5d} x {out_features:5d} x {in_features:5d}: bf16 {bf16:8.1f} us"
    for name, gemm in routes.items():
        error = (gemm(x, w_q, scale, BLOCK).double() - exact).abs().max()
        us = timer(lambda gemm=gemm: gemm(x, w_q, scale, BLOCK), args.iters)
        a_bytes = rows * in_features * (1 + 4 / BLOCK[1]) if name == "w8a8" else 0  # q_x, s_x
        gbps = (w_q.numel() + 4 * scale.numel() + act + 2 * a_bytes) / us / 1e3
        result.update({
            f"{name}_us": us, f"{name}_gbps": gbps, f"{name}_share": gbps / copy_gbps,
            f"{name}_tflops": flops / us / 1e6, f"{name}_error": float(error / exact.abs().max()),
        })  # fmt: skip
        label = "W8A16" if name == "block_fp8" else "W8A8"
        line += (
            f", {label} {us:8.1f} us ({gbps:5.0f} GB/s, {gbps / copy_gbps:4.0%} of copy, "
            f"{flops / us / 1e6:6.1f} TFLOP/s, {bf16 / us:.2f}x bf16, error "
            f"{result[f'{name}_error']:.1e})"
        )
    result["error"] = result["block_fp8_error"]  # the W8A16 GEMM's (the older JSON key)
    print(line, flush=True)
    return result


def first_w8a8_wins(results: list[dict]) -> dict[str, int | None]:
    """Per shape, the first row count at which W8A8 was faster than W8A16 (None: never)."""
    wins: dict[str, int | None] = {}
    for r in sorted(results, key=lambda r: r["rows"]):
        key = f"{r['out']}x{r['in']}"
        wins.setdefault(key, None)
        if "w8a8_us" in r and wins[key] is None and r["w8a8_us"] < r["block_fp8_us"]:
            wins[key] = r["rows"]
    return wins


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 256, 1024, 4096])
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
    # The W8A8 GEMM needs FP8 tensor cores (the interpreter runs it anywhere).
    w8a8 = args.smoke or torch.cuda.get_device_capability(device) >= (8, 9)
    if not w8a8:
        print("no FP8 tensor cores (sm_89+): the W8A8 GEMM is not measured")
    results = {"copy_gbps": copy_gbps, "block": list(BLOCK), "rows": []}
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:
        for rows in args.rows:
            results["rows"].append(measure(shape, rows, args, device, copy_gbps, w8a8))
    if w8a8:
        results["w8a8_first_wins"] = first_w8a8_wins(results["rows"])
        print(f"first row count at which W8A8 beat W8A16: {results['w8a8_first_wins']}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
