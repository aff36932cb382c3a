"""A batch-invariant matmul `y = x @ w.T (+ bias)` (EngineArgs `batch_invariant`,
docs/determinism.md).

cuBLAS picks its algorithm, tile shape and split-K factor by the problem's shape, M (the row
count) included, so a row's bits change with the batch it sits in. Here every choice is made
from N, K, the dtype and the platform only::

    grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))
    one program: rows [m0, m0 + BLOCK_M) x outputs [n0, n0 + BLOCK_N)
        acc = 0 (fp32)
        for k0 in 0, BLOCK_K, 2 BLOCK_K, ...:   the same walk over K for every row
            acc += x[rows, k0:k0+BLOCK_K] @ w[outs, k0:k0+BLOCK_K].T

BLOCK_M, BLOCK_N, BLOCK_K, warps and stages are fixed per weight (no autotune: another
configuration sums in another order), there is no split-K, and rows past M load as zeros,
which touch no other row. A row's result is then the same whether M is 1 or 200, and
whatever its place.

On a GPU the tile product is `tl.dot`: an MMA instruction computes every output element of
its tile with the same sequence of operations, so a row's bits do not depend on its place in
the tile. In Triton's interpreter `tl.dot` is numpy's `matmul`, whose BLAS micro-kernel sums a
row differently by its place in the tile (rows 0-5 and 6-15 of a 16-row tile differ in the
last bits on OpenBLAS/AVX2); there the product is a broadcast multiply and a sum over K
(`ROW_EXACT`), which numpy computes alike for every row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    dot_precision,
    is_interpreter,
)


def invariant_matmul_config(n: int, k: int, dtype: torch.dtype) -> dict[str, int]:
    """The launch configuration, a function of (N, K, dtype) and the platform only, never
    of M. On a GPU, BLOCK_M 64 (Hopper's wgmma rows; a batch-1 step is bound by the weights'
    bandwidth, not by the rows it wastes) and BLOCK_N 32 up to N = 16384 (enough programs to
    stream a 4096-wide projection's weights without split-K); in the interpreter 16 rows
    (tl.dot's least), which keeps its broadcast products small. Untuned: the numbers wait
    for a GPU measurement (benchmarks/gpu/batch_invariant_decode.py)."""
    block_n = 32 if n <= 16384 else 64
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    wide = dtype in (torch.float16, torch.bfloat16)
    block_k = (64 if wide else 32) if k >= 64 else max(16, triton.next_power_of_2(k))
    return {
        "BLOCK_M": 16 if is_interpreter() else 64,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "num_warps": 4,
        "num_stages": 3,
    }


@triton.jit
def _invariant_matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_x_row,
    stride_w_row,
    stride_out_row,
    HAS_BIAS: tl.constexpr,  # bool
    DOT_PRECISION: tl.constexpr,  # str | None, tl.dot input_precision
    ROW_EXACT: tl.constexpr,  # bool, multiply-and-sum instead of tl.dot (the interpreter)
    BLOCK_M: tl.constexpr,  # int, rows per program (fixed per platform)
    BLOCK_N: tl.constexpr,  # int, outputs per program (from N)
    BLOCK_K: tl.constexpr,  # int, reduction step (from K and the dtype)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < M
    out_valid = outs < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < K
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_x_row + ks[None, :],
            mask=row_valid[:, None] & k_valid[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_ptr + outs[:, None].to(tl.int64) * stride_w_row + ks[None, :],
            mask=out_valid[:, None] & k_valid[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_K]
        if ROW_EXACT:
            acc += tl.sum(x.to(tl.float32)[:, :, None] * tl.trans(w).to(tl.float32)[None], axis=1)
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + outs, mask=out_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_out_row + outs[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & out_valid[None, :],
    )


def invariant_matmul(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], x's dtype
    """`x @ weight.T + bias` with each row's result independent of M (module doc)."""
    check_ndim("x", x, 2, "[M, K]")
    check_ndim("weight", weight, 2, "[N, K]")
    check_dtype("x", x, (torch.float16, torch.bfloat16, torch.float32))
    if weight.dtype != x.dtype:
        raise ValueError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}.")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight must be [N, K={k}], got {tuple(weight.shape)}.")
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"bias must be [N={n}], got {tuple(bias.shape)}.")
        check_same_device(x=x, weight=weight, bias=bias)
    else:
        check_same_device(x=x, weight=weight)
    out = x.new_empty((m, n))
    if m == 0:
        return out
    config = invariant_matmul_config(n, k, x.dtype)
    # program_id(0), the row tile, varies fastest: the programs of one weight tile run
    # together and share it in L2.
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
    _invariant_matmul_kernel[grid](
        x_ptr=x,
        w_ptr=weight,
        bias_ptr=out if bias is None else bias,  # never read without a bias
        out_ptr=out,
        M=m,
        N=n,
        K=k,
        stride_x_row=x.stride(0),
        stride_w_row=weight.stride(0),
        stride_out_row=out.stride(0),
        HAS_BIAS=bias is not None,
        DOT_PRECISION=dot_precision(x.dtype),
        ROW_EXACT=is_interpreter(),
        **config,
    )
    return out


def ref_invariant_matmul(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, N]
    """Pure-torch reference: the product in float64, rounded to x's dtype."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)
