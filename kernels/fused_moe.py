"""Grouped GEMM of a mixture-of-experts layer: every expert's projection in one launch.

The step's rows (token x chosen expert) are sorted by expert; expert e owns rows
``offsets[e] : offsets[e + 1]``. The launcher cuts each expert's rows into tiles of
BLOCK_M (the host knows the counts, so no device-side alignment pass is needed) and one
program computes a [BLOCK_M, BLOCK_N] tile of

    out[i, :] = x[rows[i], :] @ w[e].T            (rows None: x[i])

    x:    [num_x_rows, k]         activations (gathered through `rows` on the fly)
    w:    [num_experts, n, k]     one weight matrix per expert
    out:  [M, n]                  M = offsets[-1], rows in the sorted order

Grid: (number of row tiles over all experts, cdiv(n, BLOCK_N)). fp32 accumulation;
`input_precision="ieee"` for fp32 inputs (tf32 would cost ~3 decimal digits).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from kernels._common import (
    FLOAT_DTYPES,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    dot_precision,
)

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def tile_rows(tile_expert_ptr, tile_start_ptr, tile_end_ptr, rows_ptr, HAS_ROWS, BLOCK_M):
    """The program's row tile (grid axis 0) of the sorted rows: its expert, the rows'
    positions in the sorted order and their mask, and the activation rows they read
    (`rows` gathers; without it row i reads x[i]). Shared by the FP8 experts' kernel."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    if HAS_ROWS:
        src = tl.load(rows_ptr + offs_m, mask=mask_m, other=0)
    else:
        src = offs_m.to(tl.int64)
    return expert, offs_m, mask_m, src


@triton.jit
def _grouped_gemm_kernel(
    x_ptr,  # [num_x_rows, k]
    rows_ptr,  # [M] int64 (read when HAS_ROWS)
    w_ptr,  # [num_experts, n, k]
    out_ptr,  # [M, n]
    tile_expert_ptr,  # [num_tiles] int32: the expert of each row tile
    tile_start_ptr,  # [num_tiles] int32: the tile's first row
    tile_end_ptr,  # [num_tiles] int32: one past the expert's last row
    n,
    k,
    stride_x,
    stride_we,
    stride_wn,
    stride_out,
    HAS_ROWS: tl.constexpr,  # bool
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # str | None
):
    expert, offs_m, mask_m, src = tile_rows(
        tile_expert_ptr, tile_start_ptr, tile_end_ptr, rows_ptr, HAS_ROWS, BLOCK_M
    )
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < k
        a = tl.load(
            x_ptr + src[:, None] * stride_x + kk[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        b = tl.load(
            w_base + offs_n[None, :] * stride_wn + kk[:, None],
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    tl.store(
        out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def row_tiles(
    offsets: list[int], device: torch.device, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, ...]:
    """(expert, first row, end row) of every `block_m` tile of every expert's rows."""
    experts, starts, ends = [], [], []
    for expert in range(len(offsets) - 1):
        for start in range(offsets[expert], offsets[expert + 1], block_m):
            experts.append(expert)
            starts.append(start)
            ends.append(offsets[expert + 1])
    # one host-to-device copy for the three (rows of one [3, num_tiles] tensor)
    tiles = torch.tensor([experts, starts, ends], dtype=torch.int32, device=device)
    return tiles[0], tiles[1], tiles[2]


def check_rows(
    x: torch.Tensor, rows: torch.Tensor | None, weight: torch.Tensor, offsets: list[int]
) -> None:
    """x's columns are weight's k, `offsets` are E + 1 ascending row offsets, and `rows`
    (int64, on x's device) has an entry for each output row."""
    num_experts, _, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, weight expects k={k}.")
    if len(offsets) != num_experts + 1 or any(b < a for a, b in itertools.pairwise(offsets)):
        raise ValueError(f"offsets must be {num_experts + 1} ascending row offsets.")
    if rows is not None:
        check_dtype("rows", rows, (torch.int64,))
        check_same_device(x=x, weight=weight, rows=rows)
        if rows.numel() < offsets[-1]:
            raise ValueError(f"rows has {rows.numel()} entries for {offsets[-1]} output rows.")
    else:
        check_same_device(x=x, weight=weight)


def moe_grouped_gemm(
    x: torch.Tensor,  # [num_x_rows, k]
    rows: torch.Tensor | None,  # [M] int64 x row of each output row; None: row i is x[i]
    weight: torch.Tensor,  # [num_experts, n, k]
    offsets: list[int],  # num_experts + 1 ascending row offsets (host values)
) -> torch.Tensor:  # [M, n]
    """out[i] = x[rows[i]] @ weight[e].T for each expert e's rows, one launch."""
    check_ndim("x", x, 2, "[num_x_rows, k]")
    check_ndim("weight", weight, 3, "[num_experts, n, k]")
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, (x.dtype,))
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    _, n, k = weight.shape
    check_rows(x, rows, weight, offsets)
    num_rows = offsets[-1]
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    tile_expert, tile_start, tile_end = row_tiles(offsets, x.device)
    grid = (tile_expert.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        x_ptr=x,
        rows_ptr=x if rows is None else rows,
        w_ptr=weight,
        out_ptr=out,
        tile_expert_ptr=tile_expert,
        tile_start_ptr=tile_start,
        tile_end_ptr=tile_end,
        n=n,
        k=k,
        stride_x=x.stride(0),
        stride_we=weight.stride(0),
        stride_wn=weight.stride(1),
        stride_out=out.stride(0),
        HAS_ROWS=rows is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION=dot_precision(x.dtype),
        num_warps=4,
    )
    return out
