"""Batched LoRA shrink / expand for a batch mixing the base model and several adapters.

    x          [num_tokens, in_features]
    a_stacked  [num_slots, max_rank, in_features]    lora_A per slot, rank-padded with zeros
    b_stacked  [num_slots, out_features, max_rank]   scaling * lora_B per slot
    indices    [num_tokens] int                      the token's slot, -1 = base model
    shrink:    h[t] = a_stacked[indices[t]] @ x[t]   [num_tokens, max_rank] fp32
    expand:    y[t] += b_stacked[indices[t]] @ h[t]  [num_tokens, out_features], in place

Grids: shrink (num_tokens, 1) over all ranks, expand (num_tokens, cdiv(out, BLOCK_N));
each program reads its token's slot once, and a base-model token (-1) loads and stores
nothing. Sums run in fp32 with elementwise products and `tl.sum` (no `tl.dot`: ranks are
small, and the interpreter's `tl.dot` mis-rounds half types). The torch reference is
`engine.lora.ops.add_lora_reference`.
"""

from __future__ import annotations

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
    next_power_of_2,
)

BLOCK_K = 64  # in_features per shrink iteration
MAX_BLOCK_N = 128


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [num_tokens, in_features]
    a_ptr,  # [num_slots, max_rank, in_features], contiguous
    indices_ptr,  # [num_tokens] int
    h_ptr,  # [num_tokens, max_rank] fp32, contiguous
    stride_x_token,
    IN_FEATURES: tl.constexpr,  # int
    MAX_RANK: tl.constexpr,  # int
    BLOCK_R: tl.constexpr,  # int, power of two
    BLOCK_K: tl.constexpr,  # int, power of two
):
    token = tl.program_id(0).to(tl.int64)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(indices_ptr + token).to(tl.int64)
    rank_mask = (ranks < MAX_RANK) & ((ranks * 0 + slot) >= 0)  # none for a base token
    a_rows = a_ptr + slot * MAX_RANK * IN_FEATURES + ranks[:, None] * IN_FEATURES
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, IN_FEATURES, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = (cols < IN_FEATURES) & ((cols * 0 + slot) >= 0)
        x = tl.load(x_ptr + token * stride_x_token + cols, mask=col_mask, other=0.0)
        a = tl.load(a_rows + cols[None, :], mask=rank_mask[:, None] & col_mask[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(h_ptr + token * MAX_RANK + ranks, acc, mask=ranks < MAX_RANK)


@triton.jit
def _lora_expand_kernel(
    h_ptr,  # [num_tokens, max_rank] fp32, contiguous
    b_ptr,  # [num_slots, out_features, max_rank], contiguous
    indices_ptr,  # [num_tokens] int
    y_ptr,  # [num_tokens, out_features] (a column range of a wider output is fine)
    stride_y_token,
    OUT_FEATURES: tl.constexpr,  # int
    MAX_RANK: tl.constexpr,  # int
    BLOCK_N: tl.constexpr,  # int, power of two
    BLOCK_R: tl.constexpr,  # int, power of two >= MAX_RANK
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    slot = tl.load(indices_ptr + token).to(tl.int64)
    col_mask = (cols < OUT_FEATURES) & ((cols * 0 + slot) >= 0)  # none for a base token
    rank_mask = (ranks < MAX_RANK) & ((ranks * 0 + slot) >= 0)
    h = tl.load(h_ptr + token * MAX_RANK + ranks, mask=rank_mask, other=0.0)
    b_rows = b_ptr + slot * OUT_FEATURES * MAX_RANK + cols[:, None] * MAX_RANK
    b = tl.load(b_rows + ranks[None, :], mask=col_mask[:, None] & rank_mask[None, :], other=0.0)
    delta = tl.sum(b.to(tl.float32) * h[None, :], axis=1)  # [BLOCK_N]
    y_row = y_ptr + token * stride_y_token + cols
    y = tl.load(y_row, mask=col_mask, other=0.0)
    tl.store(y_row, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=col_mask)


def add_lora_triton(
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    a_stacked: torch.Tensor,  # [num_slots, max_rank, in_features]
    b_stacked: torch.Tensor,  # [num_slots, out_features, max_rank]
    indices: torch.Tensor,  # [num_tokens] int, -1 = base model
) -> torch.Tensor:
    """y += per-token LoRA update (see the module doc); returns y."""
    check_ndim("x", x, 2, "[num_tokens, in_features]")
    check_ndim("y", y, 2, "[num_tokens, out_features]")
    check_ndim("a_stacked", a_stacked, 3, "[num_slots, max_rank, in_features]")
    check_ndim("b_stacked", b_stacked, 3, "[num_slots, out_features, max_rank]")
    for name, tensor in (("x", x), ("y", y), ("a_stacked", a_stacked), ("b_stacked", b_stacked)):
        check_dtype(name, tensor, FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("y", y)
    check_contiguous("a_stacked", a_stacked)
    check_contiguous("b_stacked", b_stacked)
    check_contiguous("indices", indices)
    check_same_device(y=y, x=x, a_stacked=a_stacked, b_stacked=b_stacked, indices=indices)
    num_tokens, in_features = x.shape
    num_slots, max_rank, a_in = a_stacked.shape
    out_features = y.shape[1]
    if a_in != in_features or b_stacked.shape != (num_slots, out_features, max_rank):
        raise ValueError(
            f"a_stacked {tuple(a_stacked.shape)} / b_stacked {tuple(b_stacked.shape)} do not "
            f"fit x [{num_tokens}, {in_features}] and y {tuple(y.shape)}."
        )
    if y.shape[0] != num_tokens or indices.shape != (num_tokens,) or indices.is_floating_point():
        raise ValueError(f"indices must be [{num_tokens}] integers, got {tuple(indices.shape)}.")
    if num_tokens == 0:
        return y
    h = torch.empty((num_tokens, max_rank), dtype=torch.float32, device=x.device)
    block_r = next_power_of_2(max_rank)
    _lora_shrink_kernel[(num_tokens, 1)](
        x_ptr=x,
        a_ptr=a_stacked,
        indices_ptr=indices,
        h_ptr=h,
        stride_x_token=x.stride(0),
        IN_FEATURES=in_features,
        MAX_RANK=max_rank,
        BLOCK_R=block_r,
        BLOCK_K=BLOCK_K,
    )
    block_n = min(MAX_BLOCK_N, next_power_of_2(out_features))
    _lora_expand_kernel[(num_tokens, triton.cdiv(out_features, block_n))](
        h_ptr=h,
        b_ptr=b_stacked,
        indices_ptr=indices,
        y_ptr=y,
        stride_y_token=y.stride(0),
        OUT_FEATURES=out_features,
        MAX_RANK=max_rank,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
    )
    return y
