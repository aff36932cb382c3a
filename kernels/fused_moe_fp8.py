"""Grouped GEMM of a mixture-of-experts layer whose experts are FP8 (E4M3): W8A16.

The same sorted-rows scheme as kernels/fused_moe.py (expert e owns the sorted rows
``offsets[e] : offsets[e + 1]``, cut into tiles on the host), with each expert's weight
kept in FP8 and scaled in one of two ways::

    out[i, n] = sum_k x[rows[i], k] * W[e, n, k] * S[e, n // BN, k // BK]     (block)
    out[i, n] = S[e, n] * sum_k x[rows[i], k] * W[e, n, k]                   (per channel)

    x  [num_x_rows, K] fp16 / bf16 / fp32     W  fp8 [E, N, K]
    S  fp32 [E, ceil(N / BN), ceil(K / BK)]   (block: transformers' `weight_block_size`,
                                               compressed-tensors' FP8_BLOCK; ragged edges)
       fp32 [E, N]  or  [E]                   (per channel / per tensor)
    out [M, N] in x's dtype, rows in the sorted order (M = offsets[-1])

The block mode is kernels/fp8_block_gemm.py's loop per expert: a K step never straddles a
scale column (BLOCK_K, a power of two, divides BK), the step's fp32 dot is multiplied by
the scales of its rows' blocks, and the FP8 weight is converted exactly to x's dtype, never
rounded. Per channel the scale multiplies each output once, after the whole K loop. The
activations are not quantized: no FP8 tensor cores needed, any GPU Triton runs on::

    grid (row tiles over all experts, cdiv(N, BLOCK_N))
    program (tile, n): expert e, rows start:end of e's rows; acc[BLOCK_M, BLOCK_N] fp32 = 0
        for each K step: acc += dot(x[rows], W[e, n tile, step].T)  (* S block, block mode)
        (per channel: acc *= S[e, n tile]);  out = acc in x's dtype

BLOCK_M follows the most rows any expert has (16 for decode steps, up to 64). The tile
configs (BLOCK_N, BLOCK_K, warps, stages) are the dense block GEMM's, autotuned on the GPU
keyed on BLOCK_M, N, K, the scale columns and the mode; the interpreter cannot time and
takes the first that fits (the tests pass explicit configs).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from kernels._common import (
    check_contiguous,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    dot_precision,
    even_k,
    launch_tuned,
)
from kernels.fp8_block_gemm import (
    _CACHE_RESULTS,
    ACTIVATION_DTYPES,
    FP8_DTYPE,
    GPU_CONFIGS,
    MAX_BLOCK_K,
    BlockGemmConfig,
    candidate_configs,
    kernel_takes_block,
)
from kernels.fused_moe import check_rows, row_tiles, tile_rows

MAX_BLOCK_M = 64


def moe_row_bucket(offsets: list[int]) -> int:
    """BLOCK_M for these experts' rows: 16 (decode), 32, or 64 (the largest count's bucket)."""
    most = max((b - a for a, b in itertools.pairwise(offsets)), default=1)
    return min(max(16, triton.next_power_of_2(max(most, 1))), MAX_BLOCK_M)


_TRITON_CONFIGS = {c: c.triton() for c in GPU_CONFIGS}


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    args = {**named_args, **kwargs}
    return [_TRITON_CONFIGS[c] for c in candidate_configs(args["BLOCK_M"], args["BLOCK_COLS"])]


@triton.jit
def _fp8_moe_gemm_kernel(
    x_ptr,  # [num_x_rows, K] fp16 / bf16 / fp32, rows stride_x apart
    rows_ptr,  # [M] int64 (read when HAS_ROWS)
    w_ptr,  # fp8 [E, N, K], K contiguous
    s_ptr,  # fp32 block grids [E, NB, KB] (KB contiguous), or [E, N] / [E] per channel
    out_ptr,  # [M, N] in x's dtype
    tile_expert_ptr,  # [num_tiles] int32
    tile_start_ptr,  # [num_tiles] int32
    tile_end_ptr,  # [num_tiles] int32
    N,
    K,
    BLOCK_ROWS,  # int: the scale block's rows (block mode)
    BLOCK_COLS,  # int: the scale block's columns, a multiple of BLOCK_K (block mode)
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,  # per channel: 0 for one scale per expert (per tensor)
    stride_out,
    HAS_ROWS: tl.constexpr,  # bool: x rows gathered through rows_ptr
    PER_CHANNEL: tl.constexpr,  # bool: S[e, n] after the K loop, else a block grid per step
    DOT_PRECISION: tl.constexpr,  # str | None
    BLOCK_M: tl.constexpr,  # int: 16, 32 or 64 (`moe_row_bucket`)
    BLOCK_N: tl.constexpr,  # int
    BLOCK_K: tl.constexpr,  # int, divides BLOCK_COLS in block mode
    EVEN_K: tl.constexpr,  # bool: K a multiple of BLOCK_K (no K mask)
):
    expert, offs_m, mask_m, src = tile_rows(
        tile_expert_ptr, tile_start_ptr, tile_end_ptr, rows_ptr, HAS_ROWS, BLOCK_M
    )
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    s_base = s_ptr + expert * stride_se
    s_rows = s_base + (offs_n // BLOCK_ROWS).to(tl.int64) * stride_sn  # [BLOCK_N] (block)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + src[:, None] * stride_x + offs_k[None, :]
        w_ptrs = w_rows + offs_k[None, :]
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)  # [BLOCK_N, BLOCK_K] fp8
        else:
            mask_k = offs_k < K
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
        if PER_CHANNEL:
            acc += part
        else:
            s = tl.load(s_rows + k0 // BLOCK_COLS, mask=mask_n, other=0.0)  # [BLOCK_N] fp32
            acc += part * s[None, :]
    if PER_CHANNEL:
        s = tl.load(s_base + offs_n.to(tl.int64) * stride_sn, mask=mask_n, other=0.0)
        acc = acc * s[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


_fp8_moe_gemm = triton.heuristics({"EVEN_K": even_k})(_fp8_moe_gemm_kernel)
_fp8_moe_gemm_autotuned = triton.autotune(
    configs=list(_TRITON_CONFIGS.values()),
    key=["BLOCK_M", "N", "K", "BLOCK_COLS", "PER_CHANNEL"],
    prune_configs_by={"early_config_prune": _prune},
    **_CACHE_RESULTS,
)(_fp8_moe_gemm)


def _check_scale(
    weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int] | None
) -> None:
    check_dtype("weight_scale", scale, (torch.float32,))
    check_contiguous("weight_scale", scale)
    num_experts, n, k = weight.shape
    if block_size is None:
        if tuple(scale.shape) not in ((num_experts, n), (num_experts,)):
            raise ValueError(
                f"weight_scale must be per channel [{num_experts}, {n}] or per tensor "
                f"[{num_experts}] (no block_size), got shape {list(scale.shape)}."
            )
        return
    if len(block_size) != 2 or not kernel_takes_block(tuple(block_size)):
        raise ValueError(
            f"block_size must be [rows, cols] with cols a multiple of 16 (a K step inside "
            f"one scale column), got {list(block_size)}."
        )
    grid = (num_experts, triton.cdiv(n, block_size[0]), triton.cdiv(k, block_size[1]))
    if tuple(scale.shape) != grid:
        raise ValueError(
            f"weight_scale must be the block grids {list(grid)} of [{num_experts}, {n}, {k}] "
            f"weights in blocks {list(block_size)}, got shape {list(scale.shape)}."
        )


def fp8_moe_grouped_gemm(
    x: torch.Tensor,  # [num_x_rows, K] fp16 / bf16 / fp32
    rows: torch.Tensor | None,  # [M] int64 x row of each output row; None: row i is x[i]
    weight: torch.Tensor,  # fp8 [E, N, K]
    weight_scale: torch.Tensor,  # fp32 [E, ceil(N/rows), ceil(K/cols)], [E, N] or [E]
    offsets: list[int],  # E + 1 ascending row offsets (host values)
    block_size: tuple[int, int] | None = None,  # (rows, cols); None: per channel / tensor
    config: BlockGemmConfig | None = None,  # None: autotuned
) -> torch.Tensor:  # [M, N] in x's dtype
    """out[i] = x[rows[i]] @ (W[e] scaled).T for each expert e's rows, one launch, the FP8
    weight dequantized in registers (see the module doc)."""
    check_ndim("x", x, 2, "[num_x_rows, K]")
    check_dtype("x", x, ACTIVATION_DTYPES)
    check_last_dim_contiguous("x", x)
    check_ndim("weight", weight, 3, "[num_experts, N, K]")
    check_dtype("weight", weight, (FP8_DTYPE,))
    check_contiguous("weight", weight)
    _check_scale(weight, weight_scale, block_size)
    check_rows(x, rows, weight, offsets)
    check_same_device(weight=weight, weight_scale=weight_scale)
    _, n, k = weight.shape
    num_rows = offsets[-1]
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    per_channel = block_size is None
    # Per channel the scale columns do not bound the K step: the widest step is allowed.
    block_rows, block_cols = (1, MAX_BLOCK_K) if block_size is None else tuple(map(int, block_size))
    bucket = moe_row_bucket(offsets)
    if config is not None and not config.fits(bucket, block_cols):
        raise ValueError(f"config {config} does not fit {bucket}-row tiles, {block_cols} columns.")
    tile_expert, tile_start, tile_end = row_tiles(offsets, x.device, bucket)
    stride_se = weight_scale.stride(0)
    stride_sn = 0 if weight_scale.dim() == 1 else weight_scale.stride(1)  # per tensor: 0
    args = {
        "x_ptr": x, "rows_ptr": x if rows is None else rows, "w_ptr": weight,
        "s_ptr": weight_scale, "out_ptr": out, "tile_expert_ptr": tile_expert,
        "tile_start_ptr": tile_start, "tile_end_ptr": tile_end, "N": n, "K": k,
        "BLOCK_ROWS": block_rows, "BLOCK_COLS": block_cols, "stride_x": x.stride(0),
        "stride_we": weight.stride(0), "stride_wn": weight.stride(1), "stride_se": stride_se,
        "stride_sn": stride_sn, "stride_out": out.stride(0), "HAS_ROWS": rows is not None,
        "PER_CHANNEL": per_channel, "DOT_PRECISION": dot_precision(x.dtype), "BLOCK_M": bucket,
    }  # fmt: skip

    def grid(meta: dict) -> tuple[int, int]:
        return tile_expert.numel(), triton.cdiv(n, meta["BLOCK_N"])

    launch_tuned(_fp8_moe_gemm_autotuned, _fp8_moe_gemm, grid, args, config)
    return out


def dequantize_experts(
    weight: torch.Tensor,  # fp8 [E, N, K]
    weight_scale: torch.Tensor,  # [E, NB, KB], [E, N] or [E]
    block_size: tuple[int, int] | None,
) -> torch.Tensor:  # float64 [E, N, K]
    """The real weights the FP8 experts stand for, in float64 (the tests' and the
    benchmark's reference)."""
    num_experts, n, k = weight.shape
    scale = weight_scale.double()
    if block_size is None:
        per_row = scale.reshape(num_experts, -1).expand(num_experts, n)
        return weight.double() * per_row[:, :, None]
    rows, cols = block_size
    spread = scale.repeat_interleave(rows, 1)[:, :n].repeat_interleave(cols, 2)[:, :, :k]
    return weight.double() * spread


def ref_fp8_moe_grouped_gemm(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    offsets: list[int],
    block_size: tuple[int, int] | None = None,
) -> torch.Tensor:  # float64 [M, N]
    """The float64 product of each sorted row and its expert's dequantized weight."""
    real = dequantize_experts(weight, weight_scale, block_size)
    gathered = (x if rows is None else x[rows]).double()
    out = gathered.new_zeros(offsets[-1], weight.shape[1])
    for expert in range(weight.shape[0]):
        start, end = offsets[expert], offsets[expert + 1]
        out[start:end] = gathered[start:end] @ real[expert].T
    return out
