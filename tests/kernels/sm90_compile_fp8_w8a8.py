"""The sm_90 compile check's cases (tests/kernels/sm90_compile_check.py) for the W8A8 block
FP8 GEMM (kernels/fp8_block_w8a8.py) and its activation quantization
(kernels/fp8_group_quant.py): every GEMM config its autotuner can pick for 128 x 128 blocks,
per row bucket, bf16 output, K a multiple of the step (the served shapes), and the first
two with a K tail per bucket; the quantization of bf16 rows in groups of 128 (16 rows a program, the
launcher's choice from 16 rows on, and one)."""

from __future__ import annotations

import importlib

from tests.kernels.sm90_compile_cases import CompileCase

GEMM_TYPES = {
    "a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
    "out_ptr": "*bf16",
}  # fmt: skip
QUANT_TYPES = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
SERVED_BLOCK_COLS = 128


def _gemm_case(gemm, bucket: int, config, even_k: bool) -> CompileCase:
    constexprs = {"BLOCK_M": config.tile_m(bucket), "EVEN_K": even_k, **config.triton().kwargs}
    tail = "" if even_k else " K tail"
    return CompileCase(
        f"fp8_block_w8a8 rows<={bucket}{tail} {config}",
        gemm._fp8_block_w8a8_kernel,
        GEMM_TYPES,
        constexprs,
        config.num_warps,
        config.num_stages,
    )


def fp8_w8a8_cases() -> list[CompileCase]:
    gemm = importlib.import_module("kernels.fp8_block_w8a8")
    quant = importlib.import_module("kernels.fp8_group_quant")
    cases = []
    for bucket in (16, 64, 256):
        for config in gemm.candidate_configs(bucket, SERVED_BLOCK_COLS):
            cases.append(_gemm_case(gemm, bucket, config, even_k=True))
    for bucket in (64, 256):  # a K tail: the candidates for K = 4096 + 64
        for config in gemm.candidate_configs(bucket, SERVED_BLOCK_COLS, 4096 + 64)[:2]:
            cases.append(_gemm_case(gemm, bucket, config, even_k=False))
    for rows in (16, 1):
        cases.append(
            CompileCase(
                f"fp8_group_quant bf16 groups of 128, {rows} rows a program",
                quant._quantize_groups_kernel,
                QUANT_TYPES,
                {"ROWS": rows, "GROUP_P2": 128},
                4,
                1,
            )
        )
    return cases
