"""FP8 experts (block-scaled 128 x 128) against bf16 experts: the grouped GEMMs of one MoE layer.

    python benchmarks/gpu/fp8_moe.py                  # tokens 1 16 64 256 1024, both models
    python benchmarks/gpu/fp8_moe.py --models qwen3-30b-a3b --tokens 1 64 --output-json m.json
    python benchmarks/gpu/fp8_moe.py --smoke                  # the wiring, on a CPU

Per model shape (Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, expert intermediate 768;
DeepSeek-V3: 256 experts, top-8, hidden 7168, intermediate 2048; random weights, each expert
quantized per 128 x 128 block) and token count: the layer's two grouped projections (gate|up
over the routed rows, then down) with bf16 experts (kernels/fused_moe.py, what a dequantized
checkpoint runs) and with FP8 experts (kernels/fused_moe_fp8.py, autotuned: what a kept FP8
checkpoint runs on CUDA). Timed eagerly with CUDA events over `--iters` steps, as the engine
runs its MoE layers (their row offsets are host values, so they are not graphed): micro-
seconds, GB/s of the bytes each must read (the routed experts' weights and scales, the
activations, the outputs) and their share of the copy bandwidth; the FP8 gate|up's largest
error against the float64 product on its first routed experts, relative to its largest
value; and the layer's expert bytes each way. On FP8 tensor cores (sm_89+) the W8A8
grouped GEMM (kernels/fused_moe_fp8_w8a8.py, activations quantized per token and block
column) too, with the busiest expert's rows (what picks it in the engine:
`FP8_MOE_W8A16_MAX_EXPERT_ROWS`) and its error. `--smoke` runs tiny shapes through
Triton's interpreter on the CPU with wall-clock timing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])
if "--smoke" in sys.argv:  # before any kernel module is imported: Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from benchmarks.gpu.fp8_block_gemm import quantize_blocks
from benchmarks.gpu.roofline import copy_bandwidth_gbps, mean_ms

BLOCK = (128, 128)


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    top_k: int
    hidden: int
    inter: int


MODELS = {
    "qwen3-30b-a3b": MoEShape(128, 8, 2048, 768),
    "deepseek-v3": MoEShape(256, 8, 7168, 2048),
}
SMOKE_MODELS = {"smoke": MoEShape(4, 2, 160, 128)}


def make_experts(shape: MoEShape, device: torch.device, dtype: torch.dtype) -> dict:
    """Random experts, each quantized per block (one expert at a time: low peak memory)."""
    generator = torch.Generator(device=device).manual_seed(shape.hidden)
    e, h, i = shape.num_experts, shape.hidden, shape.inter
    stacks = {
        "w13": torch.empty(e, 2 * i, h, device=device, dtype=dtype),
        "w2": torch.empty(e, h, i, device=device, dtype=dtype),
    }
    for name in ("w13", "w2"):
        n, k = stacks[name].shape[1:]
        stacks[f"{name}_q"] = torch.empty(e, n, k, device=device, dtype=torch.float8_e4m3fn)
        stacks[f"{name}_s"] = torch.empty(e, -(-n // BLOCK[0]), -(-k // BLOCK[1]), device=device)
        for expert in range(e):
            w = torch.randn(n, k, device=device, generator=generator) * 0.02
            stacks[f"{name}_q"][expert], stacks[f"{name}_s"][expert] = quantize_blocks(w, BLOCK)
            stacks[name][expert] = w.to(dtype)
    return stacks


def _error(x, rows, stacks, offsets, kernel=None) -> float:
    """The FP8 gate|up's largest error on the first routed experts' rows, relative (the
    W8A16 kernel's, or `kernel`'s), against the float64 product of x as given."""
    from kernels.fused_moe_fp8 import fp8_moe_grouped_gemm, ref_fp8_moe_grouped_gemm

    kernel = kernel or fp8_moe_grouped_gemm
    out = kernel(x, rows, stacks["w13_q"], stacks["w13_s"], offsets, BLOCK)
    active = [e for e in range(len(offsets) - 1) if offsets[e + 1] > offsets[e]][:4]
    worst, largest = 0.0, 0.0
    for e in active:
        a, b = offsets[e], offsets[e + 1]
        sub = [0, b - a]
        exact = ref_fp8_moe_grouped_gemm(
            x, rows[a:b], stacks["w13_q"][e : e + 1], stacks["w13_s"][e : e + 1], sub, BLOCK
        )
        worst = max(worst, float((out[a:b].double() - exact).abs().max()))
        largest = max(largest, float(exact.abs().max()))
    return worst / max(largest, 1e-30)


def measure(name: str, shape: MoEShape, tokens: int, stacks: dict, args, device, copy_gbps):
    from engine.layers.moe import select_experts, sort_rows
    from kernels.fused_moe import moe_grouped_gemm
    from kernels.fused_moe_fp8 import fp8_moe_grouped_gemm

    dtype = stacks["w13"].dtype
    generator = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, shape.hidden, device=device, dtype=dtype, generator=generator)
    logits = torch.randn(tokens, shape.num_experts, device=device, generator=generator)
    routed = sort_rows(*select_experts(logits, shape.top_k, True), shape.num_experts)
    rows, offsets = routed.token, routed.offsets
    h = torch.randn(offsets[-1], shape.inter, device=device, dtype=dtype, generator=generator)

    def bf16() -> None:
        moe_grouped_gemm(x, rows, stacks["w13"], offsets)
        moe_grouped_gemm(h, None, stacks["w2"], offsets)

    def fp8() -> None:
        fp8_moe_grouped_gemm(x, rows, stacks["w13_q"], stacks["w13_s"], offsets, BLOCK)
        fp8_moe_grouped_gemm(h, None, stacks["w2_q"], stacks["w2_s"], offsets, BLOCK)

    error = _error(x, rows, stacks, offsets)
    bf16_us, fp8_us = (mean_ms(f, args.iters, device) * 1e3 for f in (bf16, fp8))
    w8a8_us = w8a8_error = None
    if args.w8a8:
        from kernels.fused_moe_fp8_w8a8 import fp8_moe_w8a8

        def w8a8() -> None:
            fp8_moe_w8a8(x, rows, stacks["w13_q"], stacks["w13_s"], offsets, BLOCK)
            fp8_moe_w8a8(h, None, stacks["w2_q"], stacks["w2_s"], offsets, BLOCK)

        w8a8_error = _error(x, rows, stacks, offsets, fp8_moe_w8a8)
        w8a8_us = mean_ms(w8a8, args.iters, device) * 1e3
    active = sum(b > a for a, b in itertools.pairwise(offsets))
    per_expert = 3 * shape.hidden * shape.inter  # gate, up, down weights
    scales = 4 * (stacks["w13_s"][0].numel() + stacks["w2_s"][0].numel())
    act = x.element_size() * offsets[-1] * (2 * shape.hidden + 3 * shape.inter)
    bytes_bf16 = active * per_expert * x.element_size() + act
    bytes_fp8 = active * (per_expert + scales) + act
    result = {
        "model": name, "tokens": tokens, "active_experts": active, "bf16_us": bf16_us,
        "fp8_us": fp8_us, "bf16_gbps": bytes_bf16 / bf16_us / 1e3,
        "fp8_gbps": bytes_fp8 / fp8_us / 1e3, "error": error, "w8a8_us": w8a8_us,
        "w8a8_error": w8a8_error, "busiest_expert_rows": max(
            b - a for a, b in itertools.pairwise(offsets)
        ),
    }  # fmt: skip
    result["bf16_share"] = result["bf16_gbps"] / copy_gbps
    result["fp8_share"] = result["fp8_gbps"] / copy_gbps
    print(
        f"{name} {tokens:4d} tokens ({active:3d} experts): bf16 {bf16_us:8.1f} us "
        f"({result['bf16_share']:4.0%} of copy), fp8 {fp8_us:8.1f} us "
        f"({result['fp8_gbps']:6.0f} GB/s, {result['fp8_share']:4.0%} of copy, "
        f"{bf16_us / fp8_us:.2f}x bf16); error {error:.1e}"
        + (
            f"; W8A8 {w8a8_us:8.1f} us ({fp8_us / w8a8_us:.2f}x W8A16, busiest expert "
            f"{result['busiest_expert_rows']} rows, error {w8a8_error:.1e})"
            if w8a8_us is not None else ""
        ),
        flush=True,
    )  # fmt: skip
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if any(t < 1 for t in args.tokens) or args.iters < 1:
        parser.error("--tokens and --iters must be positive")
    if not torch.cuda.is_available() and not args.smoke:
        print("needs a CUDA device (or --smoke)")
        return 1
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16  # the interpreter mis-rounds bf16
    models = SMOKE_MODELS if args.smoke else {m: MODELS[m] for m in args.models}
    if args.smoke:
        args.iters, args.tokens = min(args.iters, 1), args.tokens[:2]
    # The W8A8 grouped GEMM needs FP8 tensor cores (the interpreter runs it anywhere).
    args.w8a8 = args.smoke or torch.cuda.get_device_capability(device) >= (8, 9)
    print(torch.__version__, torch.cuda.get_device_name(device) if not args.smoke else "CPU")
    copy_gbps = copy_bandwidth_gbps(device, (2 << 30) if device.type == "cuda" else 64 << 20)
    print(f"copy bandwidth (read + write): {copy_gbps:.0f} GB/s; blocks {list(BLOCK)}")
    results: dict = {"copy_gbps": copy_gbps, "block": list(BLOCK), "models": {}, "rows": []}
    for name, shape in models.items():
        stacks = make_experts(shape, device, dtype)
        bf16_bytes = stacks["w13"].nbytes + stacks["w2"].nbytes
        fp8_bytes = sum(stacks[k].nbytes for k in ("w13_q", "w13_s", "w2_q", "w2_s"))
        results["models"][name] = {"bf16_bytes": bf16_bytes, "fp8_bytes": fp8_bytes}
        print(f"{name}: one layer's experts {bf16_bytes / 2**30:.2f} GiB bf16, "
              f"{fp8_bytes / 2**30:.2f} GiB fp8 + scales")  # fmt: skip
        for tokens in args.tokens:
            results["rows"].append(measure(name, shape, tokens, stacks, args, device, copy_gbps))
        del stacks
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
