"""INT4 weight-only GEMM (AWQ / GPTQ checkpoints): dequantize-in-the-kernel for few rows,
dequantize-then-GEMM for many.

The weight of a projection [out=N, in=K] is held as engine/loader/int4_packing.py's
`Int4Weight` layout, GPTQ's packing along the input::

    qweight  int32 [K / 8, N]   nibble i (bits 4i..4i+3) of [r, n] = code q[8 r + i, n]
    scales   [G, N]  fp16/bf16/fp32     zeros [G, N] same dtype (zero points as numbers)
    W[k, n] = (q[k, n] - zeros[k // GROUP_SIZE, n]) * scales[k // GROUP_SIZE, n]

`int4_gemm(x, ...)` = x @ W: one program computes a [BLOCK_M, BLOCK_N] tile, unpacking a
[BLOCK_K, BLOCK_N] slab of codes per step and feeding `tl.dot` (tiles have 16 rows, its
minimum; a decode step's few rows are masked). It reads 4 bits per weight where a bf16 GEMM
reads 16, which is what a memory-bound decode step pays for. With many rows the GEMM is
compute-bound and a library GEMM wins: `int4_dequantize` writes W [K, N] in the activations'
dtype for the caller's matmul. Which rows count as "many" is the caller's threshold
(engine/layers/int4_linear.py). Accumulation is fp32; `input_precision="ieee"` for fp32.

Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)) for the GEMM, (cdiv(K, BLOCK_K), cdiv(N,
BLOCK_N)) for the dequantization.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels._common import (
    FLOAT_DTYPES,
    check_contiguous,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    dot_precision,
)

PACK = 8  # 4-bit codes per int32
BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 32  # a multiple of PACK; GROUP_SIZE need not be a multiple of it


@triton.jit
def _dequantized_slab(
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    offs_k,
    offs_n,
    mask_k,
    mask_n,
    stride_q,
    stride_s,
    GROUP_SIZE: tl.constexpr,  # int
):
    """W[offs_k, offs_n] in fp32: [BLOCK_K, BLOCK_N]."""
    mask = mask_k[:, None] & mask_n[None, :]
    packed = tl.load(qweight_ptr + (offs_k // 8)[:, None] * stride_q + offs_n[None, :], mask=mask)
    codes = (packed >> ((offs_k % 8) * 4)[:, None]) & 0xF  # arithmetic shift: masked after
    group = (offs_k // GROUP_SIZE)[:, None] * stride_s + offs_n[None, :]
    scale = tl.load(scales_ptr + group, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(zeros_ptr + group, mask=mask, other=0.0).to(tl.float32)
    return (codes.to(tl.float32) - zero) * scale


@triton.jit
def _int4_gemm_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # int32 [K / 8, N]
    scales_ptr,  # [G, N]
    zeros_ptr,  # [G, N]
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_x,
    stride_q,
    stride_s,
    stride_out,
    GROUP_SIZE: tl.constexpr,  # int
    BLOCK_M: tl.constexpr,  # int
    BLOCK_N: tl.constexpr,  # int
    BLOCK_K: tl.constexpr,  # int, a multiple of 8
    DOT_PRECISION: tl.constexpr,  # str | None
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        w = _dequantized_slab(
            qweight_ptr, scales_ptr, zeros_ptr, offs_k, offs_n, mask_k, mask_n, stride_q, stride_s,
            GROUP_SIZE,
        )  # fmt: skip
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    out = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _int4_dequantize_kernel(
    qweight_ptr,  # int32 [K / 8, N]
    scales_ptr,  # [G, N]
    zeros_ptr,  # [G, N]
    out_ptr,  # [K, N]
    N,
    K,
    stride_q,
    stride_s,
    stride_out,
    GROUP_SIZE: tl.constexpr,  # int
    BLOCK_N: tl.constexpr,  # int
    BLOCK_K: tl.constexpr,  # int, a multiple of 8
):
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_k = offs_k < K
    mask_n = offs_n < N
    w = _dequantized_slab(
        qweight_ptr, scales_ptr, zeros_ptr, offs_k, offs_n, mask_k, mask_n, stride_q, stride_s,
        GROUP_SIZE,
    )  # fmt: skip
    out = out_ptr + offs_k.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_n[None, :])


def _check_weight(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> tuple[int, int]:
    """(K, N) of a valid INT4 weight; ValueError naming the first bad argument."""
    check_ndim("qweight", qweight, 2, "[K / 8, N]")
    check_dtype("qweight", qweight, (torch.int32,))
    check_contiguous("qweight", qweight)
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    if group_size < 1 or k % group_size:
        raise ValueError(f"group_size must divide K={k}, got {group_size}.")
    for name, tensor in (("scales", scales), ("zeros", zeros)):
        check_dtype(name, tensor, FLOAT_DTYPES)
        check_contiguous(name, tensor)
        if tuple(tensor.shape) != (k // group_size, n):
            raise ValueError(f"{name} must be [{k // group_size}, {n}], got {list(tensor.shape)}.")
    return k, n


def _weight_args(
    qweight: torch.Tensor,  # int32 [K / 8, N]
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N]
    group_size: int,
    out: torch.Tensor,  # [M, N] or [K, N]
) -> dict[str, Any]:
    """The launch arguments both kernels take: the weight, the output and the tile sizes."""
    return {
        "qweight_ptr": qweight,
        "scales_ptr": scales,
        "zeros_ptr": zeros,
        "out_ptr": out,
        "N": qweight.shape[1],
        "K": qweight.shape[0] * PACK,
        "stride_q": qweight.stride(0),
        "stride_s": scales.stride(0),
        "stride_out": out.stride(0),
        "GROUP_SIZE": group_size,
        "BLOCK_N": BLOCK_N,
        "BLOCK_K": BLOCK_K,
        "num_warps": 4,
    }


def int4_gemm(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # int32 [K / 8, N]
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N]
    group_size: int,
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ W with W dequantized tile by tile inside the kernel (see the module doc)."""
    k, n = _check_weight(qweight, scales, zeros, group_size)
    check_ndim("x", x, 2, "[M, K]")
    check_dtype("x", x, FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    check_same_device(x=x, qweight=qweight, scales=scales, zeros=zeros)
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weight K={k}.")
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _int4_gemm_kernel[grid](
        **_weight_args(qweight, scales, zeros, group_size, out),
        x_ptr=x,
        M=m,
        stride_x=x.stride(0),
        BLOCK_M=BLOCK_M,
        DOT_PRECISION=dot_precision(x.dtype),
    )
    return out


def int4_dequantize(
    qweight: torch.Tensor,  # int32 [K / 8, N]
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N]
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [K, N] of `dtype`
    """W as a dense [K, N] matrix in `dtype` (fp32 math, rounded once)."""
    k, n = _check_weight(qweight, scales, zeros, group_size)
    check_same_device(qweight=qweight, scales=scales, zeros=zeros)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}.")
    out = torch.empty((k, n), dtype=dtype, device=qweight.device)
    if k == 0 or n == 0:
        return out
    grid = (triton.cdiv(k, BLOCK_K), triton.cdiv(n, BLOCK_N))
    _int4_dequantize_kernel[grid](**_weight_args(qweight, scales, zeros, group_size, out))
    return out
