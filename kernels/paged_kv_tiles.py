"""The Triton pieces the paged attention kernels share (kernels/paged_attention.py,
kernels/flash_prefill.py, kernels/batch_invariant_attention.py): which request a program
id serves, one tile of keys and values gathered from the paged cache, and one tile's step
of the online softmax.

    find_request      program id -> request, a binary search over query_start_loc
    find_query_tile   program id -> request, its query rows and the program's query tile
    kv_tile_offsets   where BLOCK_N positions' rows of one KV head lie in the cache
    load_kv_tile      [BLOCK_N, HEAD_DIM_PADDED] keys and values of BLOCK_N positions,
                      each looked up in the block table (an FP8 cache dequantized)
    attend_kv_tile    scores = q @ k^T (soft-capped, masked), then the running max m,
                      sum l and output acc rescaled and updated (base-2 exponentials)

They are `@triton.jit` functions, inlined into each kernel that calls them, so sharing
them costs nothing at run time.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels._math import tanh

LOG2_E = 1.4426950408889634


@triton.jit
def find_request(query_start_loc_ptr, num_reqs, pid, q_first, BLOCK_Q: tl.constexpr):
    """Largest request r with first(r) <= pid; first(r) is strictly increasing in r."""
    lo = tl.full((), 0, tl.int32)
    hi = tl.full((), 0, tl.int32) + num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_mid = (tl.load(query_start_loc_ptr + mid) - q_first) // BLOCK_Q + mid
        owns = first_mid <= pid
        lo = tl.where(owns, mid, lo)
        hi = tl.where(owns, hi, mid - 1)
    return lo


@triton.jit
def find_query_tile(query_start_loc_ptr, num_reqs, pid, BLOCK_Q: tl.constexpr):
    """(req, q_start, q_len, q_tile): the request program `pid` serves, its first row and
    query length, and the program's tile of BLOCK_Q query tokens (tokens from
    q_tile * BLOCK_Q, which is >= q_len for a spare id: the caller returns)."""
    q_first = tl.load(query_start_loc_ptr)
    req = find_request(query_start_loc_ptr, num_reqs, pid, q_first, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_tile = pid - ((q_start - q_first) // BLOCK_Q + req)
    return req, q_start, q_len, q_tile


@triton.jit
def kv_tile_offsets(
    block_table_row,  # this request's row of the block table
    kv_pos,  # [BLOCK_N] key positions
    kv_valid,  # [BLOCK_N] positions whose block id is read
    kv_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
):
    """[BLOCK_N] int64 offsets of the positions' (kv_head) rows in kv_cache[0] / [1]."""
    block_ids = tl.load(block_table_row + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0)
    # int64: block_id * stride_cache_block exceeds 2^31 elements on large caches.
    return (
        block_ids.to(tl.int64) * stride_cache_block
        + (kv_pos % BLOCK_SIZE) * stride_cache_slot
        + kv_head * stride_cache_head
    )


@triton.jit
def load_kv_tile(
    key_cache_ptr,
    value_cache_ptr,
    block_table_row,  # this request's row of the block table
    kv_pos,  # [BLOCK_N] key positions
    kv_valid,  # [BLOCK_N] positions inside the context
    kv_head,
    dims,  # [HEAD_DIM_PADDED]
    dim_valid,  # [HEAD_DIM_PADDED]
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    ks,  # FP8 cache: the keys' scale
    vs,  # FP8 cache: the values' scale
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    """One tile of keys and values gathered from the paged cache ([BLOCK_N, HEAD_DIM_PADDED],
    zeros outside the context), an FP8 cache's dequantized in fp32 (float(stored) * scale);
    the caller casts them to the query's dtype."""
    kv_offsets = kv_tile_offsets(
        block_table_row, kv_pos, kv_valid, kv_head, stride_cache_block, stride_cache_slot,
        stride_cache_head, BLOCK_SIZE,
    )  # fmt: skip
    kv_mask = kv_valid[:, None] & dim_valid[None, :]
    k = tl.load(key_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(value_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if IS_FP8:
        k = k.to(tl.float32) * ks
        v = v.to(tl.float32) * vs
    return k, v


@triton.jit
def attend_kv_tile(
    acc,  # [ROWS, HEAD_DIM_PADDED] fp32, the unnormalised output so far
    m_i,  # [ROWS] fp32, the running max (log2 domain)
    l_i,  # [ROWS] fp32, the running sum
    q,  # [ROWS, HEAD_DIM_PADDED]
    q_pos,  # [ROWS] absolute positions of the rows' tokens
    kv_pos,  # [BLOCK_N] key positions of the tile
    kv_valid,  # [BLOCK_N] positions inside the context
    block_table_row,
    key_cache_ptr,
    value_cache_ptr,
    kv_head,
    dims,  # [HEAD_DIM_PADDED]
    dim_valid,  # [HEAD_DIM_PADDED]
    scale_log2,  # softmax scale * log2(e)
    soft_cap_log2,  # soft-cap * log2(e) (read when HAS_SOFT_CAP)
    ks,  # fp32, an FP8 cache's key scale (1.0 otherwise)
    vs,  # fp32, its value scale
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,  # int, tokens per cache block
    SLIDING_WINDOW: tl.constexpr,  # int, each row sees its last SLIDING_WINDOW keys; 0 = all
    HAS_SOFT_CAP: tl.constexpr,  # bool, scores -> cap * tanh(scores / cap) (Gemma 2)
    MASKED: tl.constexpr,  # bool, apply the causal / window / length mask
    DOT_PRECISION: tl.constexpr,  # str | None, tl.dot input_precision
    IS_FP8: tl.constexpr,  # bool, the cache is E4M3: loads are multiplied by the scale
):
    """One key tile's step of the online softmax: (acc, m_i, l_i) after the tile."""
    k, v = load_kv_tile(
        key_cache_ptr,
        value_cache_ptr,
        block_table_row,
        kv_pos,
        kv_valid,
        kv_head,
        dims,
        dim_valid,
        stride_cache_block,
        stride_cache_slot,
        stride_cache_head,
        ks,
        vs,
        BLOCK_SIZE,
        IS_FP8,
    )
    k = k.to(q.dtype)  # from a 16-bit kv_cache_dtype (a no-op when they agree)
    v = v.to(q.dtype)

    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if HAS_SOFT_CAP:
        # cap * tanh(s / cap), both sides in the log2 domain (the ratio is the same).
        scores = soft_cap_log2 * tanh(scores / soft_cap_log2)
    if MASKED:
        visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_valid[None, :]
        if SLIDING_WINDOW > 0:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        scores = tl.where(visible, scores, float("-inf"))  # [ROWS, BLOCK_N]

    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
