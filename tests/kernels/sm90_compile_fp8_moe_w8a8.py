"""The sm_90 compile check's cases (tests/kernels/sm90_compile_check.py) for the W8A8
grouped GEMM of FP8 experts (kernels/fused_moe_fp8_w8a8.py): for 128 x 128 blocks every
config its autotuner can pick at the row buckets 16 and 64, gathered rows (gate|up), bf16
output, K a multiple of the step; the largest bucket ungathered (down) and with a K tail."""

from __future__ import annotations

import importlib

from tests.kernels.sm90_compile_cases import CompileCase

ARG_TYPES = {
    "a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "rows_ptr": "*i64", "w_ptr": "*fp8e4nv",
    "s_ptr": "*fp32", "out_ptr": "*bf16", "tile_expert_ptr": "*i32",
    "tile_start_ptr": "*i32", "tile_end_ptr": "*i32",
}  # fmt: skip
SERVED_BLOCK_COLS = 128


def _case(moe, bucket: int, config, *, rows=True, even_k=True) -> CompileCase:
    constexprs = {"HAS_ROWS": rows, "BLOCK_M": bucket, "EVEN_K": even_k, **config.triton().kwargs}
    notes = ("" if rows else " ungathered") + ("" if even_k else " K tail")
    return CompileCase(
        f"fp8_moe_w8a8 rows<={bucket}{notes} {config}",
        moe._fp8_moe_w8a8_kernel,
        ARG_TYPES,
        constexprs,
        config.num_warps,
        config.num_stages,
    )


def fp8_moe_w8a8_cases() -> list[CompileCase]:
    moe = importlib.import_module("kernels.fused_moe_fp8_w8a8")
    w8a8 = importlib.import_module("kernels.fp8_block_w8a8")
    cases = []
    for bucket in (16, 64):
        for config in w8a8.candidate_configs(bucket, SERVED_BLOCK_COLS):
            cases.append(_case(moe, bucket, config))
    first = w8a8.candidate_configs(64, SERVED_BLOCK_COLS, 4096 + 64)[0]
    cases.append(_case(moe, 64, first, rows=False))
    cases.append(_case(moe, 64, first, even_k=False))
    return cases
