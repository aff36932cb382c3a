"""Batch-invariant paged attention (EngineArgs `batch_invariant`, docs/determinism.md).

The `triton` backend attends decode rows with `paged_attention` (GQA rows packed, split-KV
by the batch size) and prefill chunks with `flash_prefill` (autotuned BLOCK_M x BLOCK_N
tiles, `tl.dot`), so a token's attention has other bits when it is decoded than when it is
prefilled, and the split and the tile depend on the batch. Here every query row, decode rows
included (one-token chunks), is one program that walks its keys alone::

    grid: (num_tokens + num_reqs, num_heads)       one program = one (query row, head)
    keys: | tile 0 | tile 1 | ... | tile t  |       BLOCK_N = 64 keys at fixed positions
           online softmax in fp32, tile by tile, keys past the row masked (-inf)

BLOCK_N and the warps are constants (no autotune), there is no split over the keys, and the
products are multiply-and-sum reductions of one row (no `tl.dot`, whose interpreter version
sums a row by its place in the tile: kernels/batch_invariant_matmul.py). A row's output then
depends only on its query, its position and the cache: the same alone or in any batch, in a
whole or a chunked prefill, after a prefix-cache hit, or decoded. Same inputs and results as
`paged_attention` (kernels/paged_attention.py), sliding window, soft-cap and sinks included.

The request search, the K/V tile addressing and the launch arguments are the other two
kernels' (kernels/paged_kv_tiles.py, kernels/paged_launch.py). Their tile load and
online-softmax step are not shared: the step multiplies a tile of rows with `tl.dot`, which
this kernel avoids, and the load reads the values with the keys, which this kernel delays
until the scores are done (one row, fp32 tiles: registers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import next_power_of_2
from kernels._math import tanh
from kernels.paged_attention_checks import check_attention_options, check_paged_attention_inputs
from kernels.paged_kv_tiles import find_query_tile, kv_tile_offsets
from kernels.paged_launch import paged_attention_args

BLOCK_N = 64  # keys per step, for every row of every launch
NUM_WARPS = 4


@triton.jit
def _invariant_attention_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (kv_cache[0])
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (kv_cache[1])
    block_tables_ptr,  # [num_reqs, max_blocks_per_req] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    scale_log2,  # softmax scale * log2(e)
    soft_cap_log2,  # soft-cap * log2(e) (read when HAS_SOFT_CAP)
    sinks_ptr,  # [num_heads] sinks, any float dtype (read when HAS_SINKS)
    num_reqs,
    stride_q_token,
    stride_q_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_req,
    stride_out_token,
    stride_out_head,
    QUERIES_PER_KV: tl.constexpr,  # int, num_heads // num_kv_heads
    BLOCK_SIZE: tl.constexpr,  # int, tokens per cache block
    HEAD_DIM: tl.constexpr,  # int
    HEAD_DIM_PADDED: tl.constexpr,  # int, power of two >= HEAD_DIM
    SLIDING_WINDOW: tl.constexpr,  # int, 0 = the whole context
    HAS_SOFT_CAP: tl.constexpr,  # bool
    HAS_SINKS: tl.constexpr,  # bool
    BLOCK_N: tl.constexpr,  # int, keys per step (fixed)
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    req, q_start, q_len, row = find_query_tile(query_start_loc_ptr, num_reqs, pid, 1)
    if row >= q_len:
        return  # a spare program id, or past the end of the batch
    seq_len = tl.load(seq_lens_ptr + req)
    q_pos = seq_len - q_len + row  # the row's absolute position: it sees keys 0..q_pos
    kv_head = head // QUERIES_PER_KV
    token = (q_start + row).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    q = tl.load(
        query_ptr + token * stride_q_token + head * stride_q_head + dims,
        mask=dim_valid,
        other=0.0,
    ).to(tl.float32)  # [HEAD_DIM_PADDED]

    m_i = tl.full((), -1.0e30, tl.float32)  # finite: exp2(m_old - m_new) stays defined
    l_i = tl.full((), 0.0, tl.float32)
    if HAS_SINKS:  # one more key of logit `sink` and value zero, seen first
        m_i = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2 domain
        l_i = tl.full((), 1.0, tl.float32)
    acc = tl.zeros([HEAD_DIM_PADDED], tl.float32)
    block_table_row = block_tables_ptr + req.to(tl.int64) * stride_bt_req
    tile_lo = 0
    if SLIDING_WINDOW > 0:
        tile_lo = tl.maximum(q_pos - SLIDING_WINDOW + 1, 0) // BLOCK_N
    for tile in range(tile_lo, tl.cdiv(q_pos + 1, BLOCK_N)):
        kv_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        visible = kv_pos <= q_pos
        if SLIDING_WINDOW > 0:
            visible = visible & (kv_pos > q_pos - SLIDING_WINDOW)
        # Masked by `visible`, not by the context length: keys the row does not see are
        # never read (zeros), so nothing but its own keys enters the row's sums.
        kv_offsets = kv_tile_offsets(
            block_table_row, kv_pos, visible, kv_head, stride_cache_block, stride_cache_slot,
            stride_cache_head, BLOCK_SIZE,
        )  # fmt: skip
        kv_mask = visible[:, None] & dim_valid[None, :]
        k = tl.load(
            key_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0
        ).to(tl.float32)  # [BLOCK_N, HEAD_DIM_PADDED]
        scores = tl.sum(k * q[None, :], axis=1) * scale_log2  # [BLOCK_N]
        if HAS_SOFT_CAP:
            scores = soft_cap_log2 * tanh(scores / soft_cap_log2)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new)  # [BLOCK_N]
        # Loaded here, not with the keys: a value tile held across the scores spills
        # registers on sm_90 (fp32, head_dim 256).
        v = tl.load(
            value_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0
        ).to(tl.float32)  # [BLOCK_N, HEAD_DIM_PADDED]
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )


def invariant_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, context length incl. this step's tokens
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32, absolute rows of query/out
    *,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """`paged_attention` (same arguments and results, rows outside the requests untouched)
    with each row computed alike whatever the batch and chunking (module doc)."""
    if out is None:
        out = torch.empty_like(query)
    check_paged_attention_inputs(query, kv_cache, block_tables, seq_lens, query_start_loc, out, 1)
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = block_tables.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    check_attention_options(query, sliding_window, logits_soft_cap, sinks)
    # Program ids per request: its query rows plus one spare (find_request's numbering).
    grid = (num_tokens + num_reqs, num_heads)
    shared = paged_attention_args(
        query, kv_cache, block_tables, seq_lens, query_start_loc, out, scale=scale,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
    )  # fmt: skip
    _invariant_attention_kernel[grid](
        **shared,
        HEAD_DIM_PADDED=next_power_of_2(head_dim),
        BLOCK_N=BLOCK_N,
        num_warps=NUM_WARPS,
        num_stages=2,
    )
    return out
