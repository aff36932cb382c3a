"""The sm_90 compile check's cases (tests/kernels/sm90_compile_check.py) for the FP8 experts'
grouped GEMM (kernels/fused_moe_fp8.py): for 128 x 128 blocks (Qwen3-*-FP8, DeepSeek-V3)
every config its autotuner can pick at the smallest and largest row buckets (16: decode; 64:
the largest accumulator), gathered rows (gate|up) with bf16
activations and K a multiple of the step (the served shapes); the decode bucket ungathered
(down) and with a K tail; and the per-channel mode at the decode bucket."""

from __future__ import annotations

import importlib

from tests.kernels.sm90_compile_cases import CompileCase

ARG_TYPES = {
    "x_ptr": "*bf16", "rows_ptr": "*i64", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
    "out_ptr": "*bf16", "tile_expert_ptr": "*i32", "tile_start_ptr": "*i32",
    "tile_end_ptr": "*i32",
}  # fmt: skip
SERVED_BLOCK_COLS = 128


def _case(moe, bucket: int, config, *, rows=True, even_k=True, per_channel=False) -> CompileCase:
    constexprs = {
        "HAS_ROWS": rows,
        "PER_CHANNEL": per_channel,
        "DOT_PRECISION": None,
        "BLOCK_M": bucket,
        "EVEN_K": even_k,
        **config.triton().kwargs,
    }
    notes = ("" if rows else " ungathered") + ("" if even_k else " K tail")
    mode = "per channel" if per_channel else "blocks"
    return CompileCase(
        f"fp8_moe_gemm {mode} rows<={bucket}{notes} {config}",
        moe._fp8_moe_gemm_kernel,
        ARG_TYPES,
        constexprs,
        config.num_warps,
        config.num_stages,
    )


def fp8_moe_gemm_cases() -> list[CompileCase]:
    moe = importlib.import_module("kernels.fused_moe_fp8")
    block = importlib.import_module("kernels.fp8_block_gemm")
    cases = []
    for bucket in (16, 64):
        for config in block.candidate_configs(bucket, SERVED_BLOCK_COLS):
            cases.append(_case(moe, bucket, config))
    first = block.GPU_CONFIGS[0]
    cases.append(_case(moe, 16, first, rows=False))
    cases.append(_case(moe, 16, first, even_k=False))
    cases.append(_case(moe, 16, first, per_channel=True))
    return cases
