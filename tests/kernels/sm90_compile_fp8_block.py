"""The sm_90 compile check's cases (tests/kernels/sm90_compile_check.py) for the block-scaled
FP8 GEMM (kernels/fp8_block_gemm.py): every config its autotuner can pick for 128 x 128
blocks, per row bucket, bf16 activations, K a multiple of the step (the served shapes); and
the first config with a K tail. Not fp32 activations (a test-only dtype on a GPU: its `ieee`
dots spill, as the FP8 GEMV's do)."""

from __future__ import annotations

import importlib

from tests.kernels.sm90_compile_cases import CompileCase

ARG_TYPES = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16"}
SERVED_BLOCK_COLS = 128


def _case(gemm, bucket: int, config, even_k: bool) -> CompileCase:
    constexprs = {
        "DOT_PRECISION": None,
        "BLOCK_M": bucket,
        "EVEN_K": even_k,
        **config.triton().kwargs,
    }
    tail = "" if even_k else " K tail"
    return CompileCase(
        f"fp8_block_gemm rows<={bucket}{tail} {config}",
        gemm._fp8_block_gemm_kernel,
        ARG_TYPES,
        constexprs,
        config.num_warps,
        config.num_stages,
    )


def fp8_block_gemm_cases() -> list[CompileCase]:
    gemm = importlib.import_module("kernels.fp8_block_gemm")
    cases = []
    for bucket in (16, 32, 64, 128):
        for config in gemm.GPU_CONFIGS:
            fits = config.fits(bucket, SERVED_BLOCK_COLS)
            if fits and config.block_k >= min(64, gemm.max_block_k(SERVED_BLOCK_COLS)):
                cases.append(_case(gemm, bucket, config, even_k=True))
    cases.append(_case(gemm, 16, gemm.GPU_CONFIGS[0], even_k=False))
    return cases
