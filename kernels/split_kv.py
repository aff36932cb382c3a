"""Split-KV (flash decoding) support for paged attention.

With few requests and long contexts, one program per (query tile, KV head) leaves most SMs
idle. The attention kernel then splits each context walk into `num_splits` ranges of key
tiles; split `s` writes its normalized partial output `o_s` and log-sum-exp `lse_s` (base 2).
`merge_splits` combines them per (token, head)::

    w_s = 2^(lse_s - max_s lse_s)        (0 for a split that saw no key)
    out = sum_s w_s * o_s / sum_s w_s
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kernels._common import next_power_of_2

MAX_SPLITS = 16
MIN_TOKENS_PER_SPLIT = 256


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_PADDED] fp32
    partial_lse_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32, log2 domain
    query_start_loc_ptr,  # [num_reqs + 1] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    num_reqs,
    stride_out_token,
    stride_out_head,
    NUM_HEADS: tl.constexpr,  # int
    NUM_SPLITS: tl.constexpr,  # int
    SPLITS_PADDED: tl.constexpr,  # int, power of two >= NUM_SPLITS
    HEAD_DIM: tl.constexpr,  # int
    HEAD_DIM_PADDED: tl.constexpr,  # int
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    first_token = tl.load(query_start_loc_ptr)
    end_token = tl.load(query_start_loc_ptr + num_reqs)
    if (token < first_token) | (token >= end_token):
        return  # rows outside this launch's requests are never written by the main kernel
    splits = tl.arange(0, SPLITS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    row = token.to(tl.int64) * NUM_HEADS + head
    lse = tl.load(
        partial_lse_ptr + row * NUM_SPLITS + splits,
        mask=splits < NUM_SPLITS,
        other=float("-inf"),
    )  # [SPLITS_PADDED]
    lse_max = tl.max(lse, axis=0)  # finite: split 0 always sees key position 0
    weights = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - lse_max))
    parts = tl.load(
        partial_out_ptr + (row * NUM_SPLITS + splits[:, None]) * HEAD_DIM_PADDED + dims[None, :],
        mask=(splits[:, None] < NUM_SPLITS) & (weights[:, None] > 0.0),
        other=0.0,
    )  # [SPLITS_PADDED, HEAD_DIM_PADDED]
    merged = tl.sum(parts * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(
        out_ptr + token.to(tl.int64) * stride_out_token + head * stride_out_head + dims,
        merged.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(
    device: torch.device, num_reqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int
) -> int:
    """Splits the context walk when decode programs alone would leave most SMs idle."""
    if max_query_len != 1 or device.type != "cuda":
        return 1
    num_programs = num_reqs * num_kv_heads
    index = device.index if device.index is not None else torch.cuda.current_device()
    target = 2 * _num_sms(index)
    if num_programs >= target:
        return 1
    by_occupancy = math.ceil(target / num_programs)
    by_length = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def merge_splits(
    partial_out: torch.Tensor,  # [num_tokens, num_heads, num_splits, head_dim_padded] fp32
    partial_lse: torch.Tensor,  # [num_tokens, num_heads, num_splits] fp32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
) -> None:
    """Writes the merged rows `[query_start_loc[0], query_start_loc[-1])` of `out`."""
    num_tokens, num_heads, num_splits, head_dim_padded = partial_out.shape
    assert partial_out.is_contiguous() and partial_lse.is_contiguous()
    assert partial_out.dtype == partial_lse.dtype == torch.float32
    assert partial_lse.shape == (num_tokens, num_heads, num_splits)
    assert out.shape[:2] == (num_tokens, num_heads) and out.stride(-1) == 1
    _merge_splits_kernel[(num_tokens, num_heads)](
        partial_out_ptr=partial_out,
        partial_lse_ptr=partial_lse,
        query_start_loc_ptr=query_start_loc,
        out_ptr=out,
        num_reqs=query_start_loc.shape[0] - 1,
        stride_out_token=out.stride(0),
        stride_out_head=out.stride(1),
        NUM_HEADS=num_heads,
        NUM_SPLITS=num_splits,
        SPLITS_PADDED=next_power_of_2(num_splits),
        HEAD_DIM=out.shape[2],
        HEAD_DIM_PADDED=head_dim_padded,
        num_warps=4,
    )
