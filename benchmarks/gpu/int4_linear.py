"""Where the INT4 layer should switch from the in-kernel dequantization to dequantize-then-
cuBLAS: both routes of `Int4LinearMethod` timed per row count on Llama-3.1-8B's projection
shapes, as the engine's crossover calibration times them (engine/layers/crossover.py).

    python benchmarks/gpu/int4_linear.py                       # rows 1 .. 128
    python benchmarks/gpu/int4_linear.py --rows 1 16 64 256 --output-json int4_routes.json
    python benchmarks/gpu/int4_linear.py --smoke               # the wiring, on a CPU

Prints, per shape and row count, microseconds per layer of `int4_gemm` (the kernel) and of
`int4_dequantize` + matmul (the GEMM), the bytes each reads per second and as a share of the
copy bandwidth (benchmarks/gpu/route_timing.py), and the crossover per shape the engine's
calibration would pick from these timings. Without a GPU (and without --smoke) it says so
and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])
if "--smoke" in sys.argv:  # before any kernel module is imported: Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from benchmarks.gpu.roofline import copy_bandwidth_gbps
from benchmarks.gpu.route_timing import ROWS, num_copies, sweep, timer_for
from engine.layers.int4_linear import Int4LinearMethod
from engine.loader.int4_packing import Int4Weight

# (in, out) of Llama-3.1-8B's fused projections: q|k|v, o, gate|up, down
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
SMOKE_SHAPES = {"a": (64, 48), "b": (128, 32)}


def random_part(k: int, n: int, group: int, device: torch.device, seed: int) -> Int4Weight:
    """Random codes, fp16 scales near a trained model's, zero points 8 (symmetric GPTQ)."""
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-(2**31), 2**31, (k // 8, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(k // group, n, generator=gen) * 0.004 + 0.002).half()
    zeros = torch.full((k // group, n), 8.0).half()
    return Int4Weight(qweight.to(device), scales.to(device), zeros.to(device), group, None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA device: nothing to measure")
        return 0
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    group = 32 if args.smoke else args.group_size
    copy_gbps = copy_bandwidth_gbps(device, (2 << 30) if device.type == "cuda" else 64 << 20)
    print(f"copy bandwidth (read + write): {copy_gbps:.0f} GB/s", flush=True)
    results = {"copy_gbps": copy_gbps, "group_size": group, "shapes": {}}
    for name, (k, n) in (SMOKE_SHAPES if args.smoke else SHAPES).items():
        part = random_part(k, n, group, device, seed=k + n)
        layer_bytes = sum(t.numel() * t.element_size() for t in (part.qweight, part.scales,
                                                                 part.zeros))  # fmt: skip
        methods = [
            Int4LinearMethod([part if i == 0 else random_part(k, n, group, device, seed=i)])
            for i in range(num_copies(layer_bytes, device))
        ]
        label = f"int4 {name} {n}x{k} g{group}"
        results["shapes"][label] = sweep(
            label, methods, layer_bytes, n, tuple(args.rows), dtype, device, copy_gbps,
            timer_for(device),
        )  # fmt: skip
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
