"""Grouped GEMM of block-scaled FP8 experts on FP8 tensor cores: W8A8.

kernels/fused_moe_fp8.py's sorted-rows scheme (expert e owns the sorted rows
``offsets[e] : offsets[e + 1]``, cut into tiles on the host; row i reads activation row
rows[i]) with kernels/fp8_block_w8a8.py's K loop: the activations arrive quantized per token
and per group of the block's columns (kernels/fp8_group_quant.py, before the gather, so each
token is quantized once however many experts read it)::

    out[i, n] = sum_g A_s[rows[i], g] * S[e, n // BN, g] * sum_{k in g} A[rows[i], k] * W[e, n, k]

        A fp8 [num_x_rows, K], A_s fp32 [num_x_rows, ceil(K / BK)]
        W fp8 [E, N, K],       S fp32 [E, ceil(N / BN), ceil(K / BK)]   (BN, BK) = block

    grid (row tiles over all experts, cdiv(N, BLOCK_N))
    program (tile, n): expert e; acc[BLOCK_M, BLOCK_N] fp32 = 0
        for each K step (inside one scale column g): part = dot(A[rows], W[e, n tile].T)
            acc += part * A_s[rows, g][:, None] * S[e, n rows // BN, g][None, :]

Block-scaled experts only (per-channel FP8 experts keep the W8A16 kernel). BLOCK_M is the
experts' row bucket (`moe_row_bucket`: 16 .. 64; a config's `block_m` is not used), the
other tile sizes W8A8Config's,
autotuned on the GPU keyed on BLOCK_M, N, K and the scale columns (GROUP_M is unused: the
tiles of one expert already run side by side); the interpreter takes the first that fits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    check_ndim,
    even_k,
    launch_tuned,
)
from kernels.fp8_block_gemm import _CACHE_RESULTS
from kernels.fp8_block_w8a8 import (
    GPU_CONFIGS,
    MIN_FP8_BLOCK_K,
    OUT_DTYPES,
    W8A8Config,
    candidate_configs,
    check_w8a8_operands,
    w8a8_k_loop,
    w8a8_takes_block,
)
from kernels.fp8_group_quant import quantize_per_token_group_fp8
from kernels.fused_moe import check_rows, row_tiles, tile_rows
from kernels.fused_moe_fp8 import moe_row_bucket

_TRITON_CONFIGS = {c: c.triton() for c in GPU_CONFIGS}


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The dense candidates, once per tile (their `block_m` is not used here)."""
    args = {**named_args, **kwargs}
    fitting = candidate_configs(args["BLOCK_M"], args["BLOCK_COLS"], args["K"])
    tiles = {(c.block_n, c.block_k, c.num_warps, c.num_stages): c for c in reversed(fitting)}
    return [_TRITON_CONFIGS[c] for c in fitting if c in tiles.values()]


@triton.jit
def _fp8_moe_w8a8_kernel(
    a_ptr,  # fp8 [num_x_rows, K], rows stride_a apart
    as_ptr,  # fp32 [num_x_rows, groups], strides (stride_as_m, stride_as_g)
    rows_ptr,  # [M] int64 (read when HAS_ROWS)
    w_ptr,  # fp8 [E, N, K], K contiguous
    s_ptr,  # fp32 [E, NB, KB], KB contiguous
    out_ptr,  # [M, N]
    tile_expert_ptr,  # [num_tiles] int32
    tile_start_ptr,  # [num_tiles] int32
    tile_end_ptr,  # [num_tiles] int32
    N,
    K,
    BLOCK_ROWS,  # int: the scale block's rows
    BLOCK_COLS,  # int: the scale block's columns, a multiple of BLOCK_K
    stride_a,
    stride_as_m,
    stride_as_g,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    HAS_ROWS: tl.constexpr,  # bool: activation rows gathered through rows_ptr
    BLOCK_M: tl.constexpr,  # int: 16, 32 or 64 (`moe_row_bucket`)
    BLOCK_N: tl.constexpr,  # int
    BLOCK_K: tl.constexpr,  # int, divides BLOCK_COLS, >= 32
    GROUP_M: tl.constexpr,  # int: W8A8Config's swizzle, unused here
    EVEN_K: tl.constexpr,  # bool: K a multiple of BLOCK_K (no K mask)
):
    expert, offs_m, mask_m, src = tile_rows(
        tile_expert_ptr, tile_start_ptr, tile_end_ptr, rows_ptr, HAS_ROWS, BLOCK_M
    )
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    a_ptrs = a_ptr + src[:, None] * stride_a + tl.arange(0, BLOCK_K)[None, :]
    w_ptrs = (
        w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        + tl.arange(0, BLOCK_K)[None, :]
    )  # fmt: skip
    as_rows = as_ptr + src * stride_as_m  # [BLOCK_M] pointers
    s_rows = s_ptr + expert * stride_se + (offs_n // BLOCK_ROWS).to(tl.int64) * stride_sn
    acc = w8a8_k_loop(
        a_ptrs, w_ptrs, as_rows, s_rows, stride_as_g, mask_m, mask_n, K, BLOCK_COLS,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
    )  # fmt: skip
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


_fp8_moe_w8a8 = triton.heuristics({"EVEN_K": even_k})(_fp8_moe_w8a8_kernel)
_fp8_moe_w8a8_autotuned = triton.autotune(
    configs=list(_TRITON_CONFIGS.values()),
    key=["BLOCK_M", "N", "K", "BLOCK_COLS"],
    prune_configs_by={"early_config_prune": _prune},
    **_CACHE_RESULTS,
)(_fp8_moe_w8a8)


def fp8_moe_w8a8_quantized(
    a: torch.Tensor,  # fp8 [num_x_rows, K]
    a_scale: torch.Tensor,  # fp32 [num_x_rows, ceil(K / cols)], any strides
    rows: torch.Tensor | None,  # [M] int64 activation row of each output row; None: row i
    weight: torch.Tensor,  # fp8 [E, N, K]
    weight_scale: torch.Tensor,  # fp32 [E, ceil(N / rows), ceil(K / cols)]
    offsets: list[int],  # E + 1 ascending row offsets (host values)
    block_size: tuple[int, int],
    out_dtype: torch.dtype,
    config: W8A8Config | None = None,  # None: autotuned
) -> torch.Tensor:  # [M, N] in out_dtype
    """The grouped GEMM of already quantized activations (see the module doc)."""
    check_w8a8_operands(a, a_scale, weight, weight_scale, block_size, rows="num_x_rows")
    check_rows(a, rows, weight, offsets)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}.")
    _, n, k = weight.shape
    num_rows = offsets[-1]
    out = torch.empty((num_rows, n), dtype=out_dtype, device=a.device)
    if num_rows == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    block_rows, block_cols = int(block_size[0]), int(block_size[1])
    bucket = moe_row_bucket(offsets)
    even_k = config is None or k % config.block_k == 0
    if config is not None and not config.fits(bucket, block_cols, even_k):
        raise ValueError(f"config {config} does not fit {bucket}-row tiles, {block_cols} columns.")
    tile_expert, tile_start, tile_end = row_tiles(offsets, a.device, bucket)
    args = {
        "a_ptr": a, "as_ptr": a_scale, "rows_ptr": a if rows is None else rows,
        "w_ptr": weight, "s_ptr": weight_scale, "out_ptr": out,
        "tile_expert_ptr": tile_expert, "tile_start_ptr": tile_start, "tile_end_ptr": tile_end,
        "N": n, "K": k, "BLOCK_ROWS": block_rows, "BLOCK_COLS": block_cols,
        "stride_a": a.stride(0), "stride_as_m": a_scale.stride(0),
        "stride_as_g": a_scale.stride(1), "stride_we": weight.stride(0),
        "stride_wn": weight.stride(1), "stride_se": weight_scale.stride(0),
        "stride_sn": weight_scale.stride(1), "stride_out": out.stride(0),
        "HAS_ROWS": rows is not None, "BLOCK_M": bucket,
    }  # fmt: skip

    def grid(meta: dict) -> tuple[int, int]:
        return tile_expert.numel(), triton.cdiv(n, meta["BLOCK_N"])

    launch_tuned(_fp8_moe_w8a8_autotuned, _fp8_moe_w8a8, grid, args, config)
    return out


def fp8_moe_w8a8(
    x: torch.Tensor,  # [num_x_rows, K] fp16 / bf16 / fp32
    rows: torch.Tensor | None,  # [M] int64
    weight: torch.Tensor,  # fp8 [E, N, K]
    weight_scale: torch.Tensor,  # fp32 [E, ceil(N / rows), ceil(K / cols)]
    offsets: list[int],
    block_size: tuple[int, int] | None,
    config: W8A8Config | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """x quantized per token and block column, then the grouped W8A8 GEMM: the signature of
    kernels/fused_moe_fp8.py's `fp8_moe_grouped_gemm` (block-scaled experts only)."""
    check_ndim("x", x, 2, "[num_x_rows, K]")
    if block_size is None or len(block_size) != 2 or not w8a8_takes_block(tuple(block_size)):
        raise ValueError(
            f"block_size must be [rows, cols] with cols a multiple of {MIN_FP8_BLOCK_K} "
            f"(an FP8 K step inside one scale column), got {block_size}."
        )
    a, a_scale = quantize_per_token_group_fp8(x, int(block_size[1]))
    return fp8_moe_w8a8_quantized(
        a, a_scale, rows, weight, weight_scale, offsets, block_size, x.dtype, config
    )
