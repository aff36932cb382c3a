"""Causal paged attention over a batch that mixes prefill chunks and decode tokens.

Request `r` owns query rows `query_start_loc[r] : query_start_loc[r + 1]`; they are the last
`query_len` tokens of its context of `seq_lens[r]` tokens, so query token `i` sits at
absolute position `seq_lens[r] - query_len + i` and sees keys at positions `<= ` that one.
Key position `p` lives in the cache at `block_tables[r, p // block_size]`, slot
`p % block_size`::

    key position:   0 ... 15 | 16 ... 31 | 32 33 34
    block_table[r]: [   7    ,    2      ,   9  ]      (block_size 16)
    kv_cache[0, 9, 2] holds the key of position 34

Grid and blocking
-----------------
One program handles one *query tile* of one request and one KV head. The tile's rows are
`BLOCK_Q` consecutive query tokens times the `QUERIES_PER_KV` query heads that share the KV
head (GQA), so K/V are read once per tile for the whole head group::

    row m  ->  token  m // GROUP,  head  kv_head * QUERIES_PER_KV + m % GROUP

Tiles are numbered over the whole batch without a host sync: request `r` owns program ids
`[first(r), first(r + 1))` with `first(r) = (query_start_loc[r] - query_start_loc[0]) //
BLOCK_Q + r` (one spare id per request at most); each program finds its request by a binary
search over `query_start_loc`, and spare ids exit at once.

The program walks the request's context in tiles of `BLOCK_N` key positions (each position
looks its block id up in the block table, so any block size works), with an online softmax
in fp32 (base-2 exponentials). The causal limit of the tile's last query row bounds the walk.
A cache in a 16-bit `kv_cache_dtype` other than the query's is converted to the query's
dtype as each tile is loaded, so the dots run in the model dtype.

The request search, the tile loads and the online-softmax step are kernels/paged_kv_tiles.py's,
shared with the prefill kernel (kernels/flash_prefill.py).

Split-KV (flash decoding): with few requests and long contexts, a third grid axis splits the
context walk into `num_splits` ranges. Each split writes a normalized partial output and its
log-sum-exp; a second kernel merges them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._common import kv_scale_args, next_power_of_2
from kernels.fp8_quant import kv_scale_values
from kernels.paged_attention_checks import check_attention_options, check_paged_attention_inputs
from kernels.paged_kv_tiles import attend_kv_tile, find_query_tile
from kernels.paged_launch import dot_tile_args, paged_attention_args
from kernels.split_kv import choose_num_splits, merge_splits


class _TileConfig(NamedTuple):
    group: int  # query heads per KV head, rounded up to a power of two
    block_q: int  # query tokens per tile; a tile has block_q * group rows
    block_n: int  # key positions per inner step
    head_dim_padded: int
    num_warps: int
    num_stages: int


def _tile_config(
    queries_per_kv: int, head_dim: int, max_query_len: int, dtype: torch.dtype
) -> _TileConfig:
    """Tile shapes per launch kind. Decode tiles have 16 rows (tl.dot's minimum; one token
    per request), prefill tiles 64 (32 in fp32) so each K/V tile serves more rows. Chosen
    so that an sm_90 build of the kernel does not spill registers (checked with ptxas
    resource usage; not yet timed on a GPU)."""
    group = next_power_of_2(queries_per_kv)
    head_dim_padded = max(16, next_power_of_2(head_dim))
    wide = head_dim_padded > 128 or dtype == torch.float32
    block_n = 32 if wide else 64
    if max_query_len == 1:
        tile_rows, num_warps, num_stages = 16, 4, 3
    else:
        tile_rows, num_warps, num_stages = (32 if dtype == torch.float32 else 64), 8, 2
    block_q = max(1, tile_rows // group)  # a head group larger than the tile: one token
    return _TileConfig(group, block_q, block_n, head_dim_padded, num_warps, num_stages)


@triton.jit
def _paged_attention_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (kv_cache[0])
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (kv_cache[1])
    block_tables_ptr,  # [num_reqs, max_blocks_per_req] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_PADDED] fp32 (split-KV)
    partial_lse_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32, log2 domain (split-KV)
    scale_log2,  # softmax scale * log2(e)
    soft_cap_log2,  # attention logit soft-cap * log2(e) (read when HAS_SOFT_CAP)
    sinks_ptr,  # [num_heads] attention sinks, any float dtype (read when HAS_SINKS)
    k_scale,  # FP8 cache: the keys' scale (a float, or a pointer when SCALE_IS_PTR)
    v_scale,  # FP8 cache: the values' scale
    num_reqs,
    stride_q_token,
    stride_q_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_req,
    stride_out_token,
    stride_out_head,
    NUM_HEADS: tl.constexpr,  # int
    QUERIES_PER_KV: tl.constexpr,  # int, num_heads // num_kv_heads
    GROUP: tl.constexpr,  # int, QUERIES_PER_KV rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # int, query tokens per tile
    BLOCK_N: tl.constexpr,  # int, key positions per inner step
    BLOCK_SIZE: tl.constexpr,  # int, tokens per cache block
    HEAD_DIM: tl.constexpr,  # int
    HEAD_DIM_PADDED: tl.constexpr,  # int, power of two >= HEAD_DIM
    NUM_SPLITS: tl.constexpr,  # int, 1 = no split-KV
    SLIDING_WINDOW: tl.constexpr,  # int, each row sees its last SLIDING_WINDOW keys; 0 = all
    HAS_SOFT_CAP: tl.constexpr,  # bool, scores -> cap * tanh(scores / cap) (Gemma 2)
    HAS_SINKS: tl.constexpr,  # bool, a per-head logit joins the softmax's sum (GPT-OSS)
    UPCAST: tl.constexpr,  # bool, compute the dots in fp32 (interpreter + bf16)
    DOT_PRECISION: tl.constexpr,  # str | None, tl.dot input_precision
    IS_FP8: tl.constexpr,  # bool, the cache is E4M3: loads are multiplied by the scale
    SCALE_IS_PTR: tl.constexpr,  # bool, k_scale / v_scale are 1-element tensors
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req, q_start, q_len, q_tile = find_query_tile(query_start_loc_ptr, num_reqs, pid, BLOCK_Q)
    if q_tile * BLOCK_Q >= q_len:
        return  # a spare program id, or past the end of the batch
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # keys already cached before this step's queries

    rows = tl.arange(0, BLOCK_Q * GROUP)
    q_idx = q_tile * BLOCK_Q + rows // GROUP  # query token inside the request
    head = kv_head * QUERIES_PER_KV + rows % GROUP
    row_valid = (q_idx < q_len) & (rows % GROUP < QUERIES_PER_KV)
    q_pos = context_len + q_idx  # absolute position of each row's token
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM

    q_offsets = token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(
        query_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0
    )  # [BLOCK_Q * GROUP, HEAD_DIM_PADDED]
    if UPCAST:
        q = q.to(tl.float32)

    # Keys visible to the tile's last row, capped at the context length.
    kv_end = tl.minimum(context_len + q_tile * BLOCK_Q + BLOCK_Q, seq_len)
    tile_lo = 0
    if SLIDING_WINDOW > 0:  # nothing before the tile's first row's window (no split-KV here)
        tile_lo = tl.maximum(context_len + q_tile * BLOCK_Q - SLIDING_WINDOW + 1, 0) // BLOCK_N
    tile_hi = tl.cdiv(kv_end, BLOCK_N)
    if NUM_SPLITS > 1:
        # This request's own walk, split evenly: the ranges never depend on the launch's
        # max_seq_len, which a captured CUDA graph fixes at max_model_len.
        kv_tiles_per_split = tl.cdiv(tile_hi, NUM_SPLITS)
        tile_lo = split * kv_tiles_per_split
        if split < NUM_SPLITS - 1:  # the last split takes whatever remains
            tile_hi = tl.minimum(tile_hi, tile_lo + kv_tiles_per_split)

    # A finite floor instead of -inf keeps exp2(m_old - m_new) defined for rows that have
    # seen only masked keys so far (their p is exp2(-inf) = 0 either way).
    m_i = tl.full([BLOCK_Q * GROUP], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP], tl.float32)
    if HAS_SINKS:
        # The sink is one more key of score `sink` whose value is zero: the walk starts as if
        # it had seen it (max = sink, sum = 1, acc = 0). Under split-KV only split 0 counts it.
        # To fp32 and the log2 domain here: no conversion kernel per layer on the host side.
        sink = (
            tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
        )
        first = split == 0
        m_i = tl.where(first, sink, m_i)
        l_i = tl.where(first, 1.0, l_i)
    acc = tl.zeros([BLOCK_Q * GROUP, HEAD_DIM_PADDED], tl.float32)
    ks, vs = kv_scale_values(k_scale, v_scale, IS_FP8, SCALE_IS_PTR)
    block_table_row = block_tables_ptr + req.to(tl.int64) * stride_bt_req

    for tile in range(tile_lo, tile_hi):
        kv_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = attend_kv_tile(
            acc, m_i, l_i, q, q_pos, kv_pos, kv_pos < kv_end, block_table_row,
            key_cache_ptr, value_cache_ptr, kv_head, dims, dim_valid, scale_log2,
            soft_cap_log2, ks, vs, stride_cache_block, stride_cache_slot, stride_cache_head,
            BLOCK_SIZE, SLIDING_WINDOW, HAS_SOFT_CAP, True, DOT_PRECISION, IS_FP8,
        )  # fmt: skip

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        out_offsets = token[:, None] * stride_out_token + head[:, None] * stride_out_head
        tl.store(
            out_ptr + out_offsets + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        row_split = (token * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_Q * GROUP]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(partial_lse_ptr + row_split, lse, mask=row_valid)
        tl.store(
            partial_out_ptr + row_split[:, None] * HEAD_DIM_PADDED + dims[None, :],
            result,
            mask=row_valid[:, None],
        )


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, context length incl. this step's tokens
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    *,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each request's query rows over its paged context.

    Row indices in `query_start_loc` are absolute rows of `query`/`out`, and they need not
    start at 0, so a caller can launch once for the decode requests and once for the
    prefill requests of one batch, writing into the same `out`. Rows of `out` outside
    `[query_start_loc[0], query_start_loc[-1])` are left untouched.

    `max_query_len` picks the tile shape (1 = decode tiles); `max_seq_len` must be >= every
    `seq_lens` entry and only sets the number of splits (the kernel splits each request's
    walk evenly, so an upper bound such as max_model_len does as well as the exact value).
    `num_splits=None` chooses split-KV by occupancy (decode-only launches on CUDA); pass an
    int to force it.
    `sliding_window`: each query row sees only the keys at its last `sliding_window`
    positions (its own included), as transformers' sliding-window mask; split-KV is not used
    with a window (the window already bounds the walk). `logits_soft_cap`: each score
    (after the scale) becomes cap * tanh(score / cap), as Gemma 2 does. `sinks`
    ([num_heads], any float dtype; converted to fp32 in the kernel): GPT-OSS's attention sinks, a
    learned logit per head added to each row's softmax sum, attending to no value.
    A float8_e4m3fn `kv_cache` (kv_cache_dtype="fp8") is read as `float(stored) * k_scale`
    (`v_scale` for values; a float or a 1-element tensor) in fp32, then in the query's dtype;
    the scales are ignored for other caches.
    """
    if out is None:
        out = torch.empty_like(query)
    check_paged_attention_inputs(
        query, kv_cache, block_tables, seq_lens, query_start_loc, out, max_query_len, fp8_ok=True
    )
    kv_scales = kv_scale_args(k_scale, v_scale, kv_cache.device)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    num_reqs = block_tables.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out

    queries_per_kv = num_heads // num_kv_heads
    tiles = _tile_config(queries_per_kv, head_dim, max_query_len, query.dtype)
    check_attention_options(query, sliding_window, logits_soft_cap, sinks)
    if sliding_window is not None:
        num_splits = 1
    if num_splits is None:
        num_splits = choose_num_splits(
            query.device, num_reqs, num_kv_heads, max_query_len, max_seq_len
        )
    if not 1 <= num_splits <= 64:
        raise ValueError(f"num_splits must be in [1, 64], got {num_splits}.")

    if num_splits > 1:  # [num_tokens, num_heads, num_splits(, head_dim_padded)] fp32
        partial_out = query.new_empty(
            (num_tokens, num_heads, num_splits, tiles.head_dim_padded), dtype=torch.float32
        )
        partial_lse = query.new_empty((num_tokens, num_heads, num_splits), dtype=torch.float32)
    else:  # never read; the kernel still takes the arguments
        partial_out = partial_lse = out

    # Program ids per request: ceil(query_len / BLOCK_Q) plus at most one spare.
    grid = (num_tokens // tiles.block_q + num_reqs, num_kv_heads, num_splits)
    shared = paged_attention_args(
        query, kv_cache, block_tables, seq_lens, query_start_loc, out, scale=scale,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
    )  # fmt: skip
    _paged_attention_kernel[grid](
        **shared,
        **dot_tile_args(query, kv_cache, kv_scales),
        partial_out_ptr=partial_out,
        partial_lse_ptr=partial_lse,
        NUM_HEADS=num_heads,
        GROUP=tiles.group,
        BLOCK_Q=tiles.block_q,
        BLOCK_N=tiles.block_n,
        HEAD_DIM_PADDED=tiles.head_dim_padded,
        NUM_SPLITS=num_splits,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if num_splits > 1:
        merge_splits(partial_out, partial_lse, query_start_loc, out)
    return out
