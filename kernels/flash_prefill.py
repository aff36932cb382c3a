"""Prefill attention over the paged KV cache, FlashAttention-2 style: prefill chunks and the
prefill part of mixed batches (the decode rows go to kernels/paged_attention.py).

The inputs and the causal rule are `paged_attention`'s (kernels/paged_attention.py): request
`r` owns query rows `query_start_loc[r] : query_start_loc[r + 1]`, the last `query_len`
tokens of its `seq_lens[r]`-token context, whose keys and values are already in the cache.

Grid and blocking (FlashAttention-2's forward)
----------------------------------------------
One program computes `BLOCK_M` query tokens of one request for one query head; GQA maps the
head to its KV head (`head // QUERIES_PER_KV`). Tiles are numbered over the whole batch as in
`paged_attention` (a binary search over `query_start_loc`, at most one spare id a request).
The program walks the keys in `BLOCK_N` tiles with an online softmax in fp32 (base-2
exponentials, the scale folded into the exponent), the two products as `tl.dot` tiles
(`BLOCK_M x D @ D x BLOCK_N` and `BLOCK_M x BLOCK_N @ BLOCK_N x D`, Hopper's wgmma shapes in
16-bit dtypes). The walk has three ranges, so the masks cost only where they cut::

    key tiles:  | window edge |        full tiles         | diagonal |     (skipped)
                  masked        every row sees every key     masked     causally invisible
                  (sliding                                   (q_pos >=
                   window only)                               kv_pos)

Tiles past the tile's last query position are never visited (causal tile skipping), and with
a sliding window neither are the tiles before the first row's window.

`triton.autotune` picks BLOCK_M, BLOCK_N, warps and pipeline stages on the GPU at the first
launch of each (head_dim, GQA ratio, dtype, query-length bucket); in the interpreter one small
configuration is used (autotuning there would only time the interpreter).

Soft-cap (Gemma 2) and attention sinks (GPT-OSS) are applied as `paged_attention` applies
them; a 16-bit `kv_cache_dtype` is converted to the query's dtype as each tile is loaded, an
FP8 one is multiplied by its per-tensor scale in fp32 first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import is_interpreter, kv_scale_args, next_power_of_2
from kernels.fp8_quant import kv_scale_values
from kernels.paged_attention_checks import check_attention_options, check_paged_attention_inputs
from kernels.paged_kv_tiles import attend_kv_tile, find_query_tile
from kernels.paged_launch import dot_tile_args, paged_attention_args


def _configs() -> list[triton.Config]:
    """Block shapes for Hopper/Ampere (16-bit: BLOCK_M 128 with 8 warps is FA2's choice at
    head_dim 128); the autotuner drops any that do not fit the shared memory."""
    if is_interpreter():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    shapes = [
        (128, 64, 8, 3),
        (128, 128, 8, 2),
        (128, 64, 4, 3),
        (128, 32, 4, 4),
        (64, 64, 4, 3),
        (64, 128, 8, 2),
        (64, 32, 4, 4),
        (64, 64, 8, 2),  # head_dim 256 (Gemma 2)
        (64, 32, 8, 2),
        (32, 32, 4, 2),
        # fp32 at head_dim 128: still spills 80 bytes a thread on sm_90 (the FMA dots), the
        # least of those tried; fp32 is not a serving dtype on a GPU.
        (32, 32, 8, 1),
    ]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in shapes
    ]


# Per-thread registers the q, accumulator and score tiles may take (of 255), estimated as
# below: at head_dim 128 in bf16, 160 (BLOCK_M 128 x BLOCK_N 128, 8 warps) compiles for sm_90
# without spills and 224 (128 x 32, 4 warps) spills (tests/kernels/sm90_compile_check.py).
MAX_TILE_REGISTERS = 160
SHARED_MEMORY_BYTES = 227 * 1024  # Hopper's per-block maximum (Ampere: 163 KiB)


def prune_configs(
    configs: list[triton.Config], head_dim: int, element_bytes: int
) -> list[triton.Config]:
    """The configurations whose tiles fit the registers and the shared memory at this head
    size and dtype (fp32 and head_dim 256 need smaller tiles than 16-bit at 128); at least
    the smallest one is kept."""
    head_dim_padded = max(16, next_power_of_2(head_dim))

    def fits(config: triton.Config) -> bool:
        m, n = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
        threads = config.num_warps * 32
        registers = (m * head_dim_padded + m * n) // threads  # acc + scores, fp32
        registers += m * head_dim_padded * element_bytes // 4 // threads  # q
        # K and V tiles per pipeline stage, and q (what sm_90 builds allocate).
        shared = (2 * n * config.num_stages + m) * head_dim_padded * element_bytes
        # fp32 dots run on the FMA units, their operands in registers: a quarter of the
        # budget (at head_dim 128, 64 x 64 spills 8 KiB with 4 warps and 7 KiB with 8).
        budget = MAX_TILE_REGISTERS if element_bytes < 4 else MAX_TILE_REGISTERS // 4
        return registers <= budget and shared <= SHARED_MEMORY_BYTES

    kept = [c for c in configs if fits(c)]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    query = kwargs.get("query_ptr", named_args.get("query_ptr"))
    head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    return prune_configs(configs, head_dim, query.element_size())


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    q,  # [BLOCK_M, HEAD_DIM_PADDED]
    q_pos,  # [BLOCK_M] absolute positions of the rows
    tile_lo,
    tile_hi,
    seq_len,
    block_table_row,  # pointer to the request's block-table row
    key_cache_ptr,
    value_cache_ptr,
    kv_head,
    scale_log2,
    soft_cap_log2,
    ks,  # fp32, an FP8 cache's key scale (1.0 otherwise)
    vs,  # fp32, its value scale
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    MASKED: tl.constexpr,  # bool, apply the causal / window / length mask
    DOT_PRECISION: tl.constexpr,
    IS_FP8: tl.constexpr,  # bool, the cache is E4M3: loads are multiplied by the scale
):
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    for tile in range(tile_lo, tile_hi):
        kv_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = attend_kv_tile(
            acc, m_i, l_i, q, q_pos, kv_pos, kv_pos < seq_len, block_table_row,
            key_cache_ptr, value_cache_ptr, kv_head, dims, dim_valid, scale_log2,
            soft_cap_log2, ks, vs, stride_cache_block, stride_cache_slot, stride_cache_head,
            BLOCK_SIZE, SLIDING_WINDOW, HAS_SOFT_CAP, MASKED, DOT_PRECISION, IS_FP8,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.autotune(
    configs=_configs(),
    key=["HEAD_DIM", "QUERIES_PER_KV", "query_len_bucket"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _flash_prefill_kernel(
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
    k_scale,  # FP8 cache: the keys' scale (a float, or a pointer when SCALE_IS_PTR)
    v_scale,  # FP8 cache: the values' scale
    num_reqs,
    query_len_bucket,  # the launch's max_query_len rounded up to a power of two (tuning key)
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
    HEAD_DIM_PADDED: tl.constexpr,  # int, power of two >= HEAD_DIM, >= 16
    SLIDING_WINDOW: tl.constexpr,  # int, 0 = the whole context
    HAS_SOFT_CAP: tl.constexpr,  # bool
    HAS_SINKS: tl.constexpr,  # bool
    UPCAST: tl.constexpr,  # bool, compute the dots in fp32 (interpreter + bf16)
    DOT_PRECISION: tl.constexpr,  # str | None, tl.dot input_precision
    IS_FP8: tl.constexpr,  # bool, the cache is E4M3: loads are multiplied by the scale
    SCALE_IS_PTR: tl.constexpr,  # bool, k_scale / v_scale are 1-element tensors
    BLOCK_M: tl.constexpr,  # int, query tokens per program (autotuned)
    BLOCK_N: tl.constexpr,  # int, key positions per inner step (autotuned)
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    req, q_start, q_len, q_tile = find_query_tile(query_start_loc_ptr, num_reqs, pid, BLOCK_M)
    if q_tile * BLOCK_M >= q_len:
        return  # a spare program id, or past the end of the batch
    seq_len = tl.load(seq_lens_ptr + req)
    kv_head = head // QUERIES_PER_KV

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query tokens inside the request
    row_valid = rows < q_len
    q_pos = seq_len - q_len + rows  # absolute positions
    token = (q_start + rows).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    q = tl.load(
        query_ptr + token[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PADDED]
    if UPCAST:
        q = q.to(tl.float32)

    # The three key ranges (module doc): [tile_lo, full_lo) masked, [full_lo, full_hi) not,
    # [full_hi, tile_hi) masked. first/last: positions of the tile's first and last real row.
    first = seq_len - q_len + q_tile * BLOCK_M
    last = tl.minimum(first + BLOCK_M, seq_len) - 1
    tile_hi = tl.cdiv(last + 1, BLOCK_N)
    full_hi = (first + 1) // BLOCK_N  # tiles whose every key is <= first
    tile_lo = 0
    full_lo = 0
    if SLIDING_WINDOW > 0:
        tile_lo = tl.maximum(first - SLIDING_WINDOW + 1, 0) // BLOCK_N
        # Tiles whose every key is inside the last row's window (so inside every row's).
        full_lo = tl.minimum(tl.cdiv(tl.maximum(last - SLIDING_WINDOW + 1, 0), BLOCK_N), full_hi)
        full_lo = tl.maximum(full_lo, tile_lo)
        full_hi = tl.maximum(full_hi, full_lo)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: exp2(m_old - m_new) stays defined
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # one more key of logit `sink` and value zero, seen first
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2 domain
        m_i = tl.zeros([BLOCK_M], tl.float32) + sink
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
    ks, vs = kv_scale_values(k_scale, v_scale, IS_FP8, SCALE_IS_PTR)
    block_table_row = block_tables_ptr + req.to(tl.int64) * stride_bt_req

    if SLIDING_WINDOW > 0:  # the window's edge (an empty range without a window)
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, tile_lo, full_lo, seq_len, block_table_row,
            key_cache_ptr, value_cache_ptr, kv_head, scale_log2, soft_cap_log2, ks, vs,
            stride_cache_block, stride_cache_slot, stride_cache_head,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PADDED, SLIDING_WINDOW, HAS_SOFT_CAP,
            True, DOT_PRECISION, IS_FP8,
        )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, full_lo, full_hi, seq_len, block_table_row,
        key_cache_ptr, value_cache_ptr, kv_head, scale_log2, soft_cap_log2, ks, vs,
        stride_cache_block, stride_cache_slot, stride_cache_head,
        BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PADDED, SLIDING_WINDOW, HAS_SOFT_CAP,
        False, DOT_PRECISION, IS_FP8,
    )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, full_hi, tile_hi, seq_len, block_table_row,
        key_cache_ptr, value_cache_ptr, kv_head, scale_log2, soft_cap_log2, ks, vs,
        stride_cache_block, stride_cache_slot, stride_cache_head,
        BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PADDED, SLIDING_WINDOW, HAS_SOFT_CAP,
        True, DOT_PRECISION, IS_FP8,
    )  # fmt: skip

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_out_token + head * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


def flash_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, context length incl. this step's tokens
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32, absolute rows of query/out
    *,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """`paged_attention` (same arguments, an FP8 cache and its scales included, and results,
    rows outside the requests untouched) with FlashAttention-2's blocking, for launches
    whose requests have many query tokens.
    `max_query_len` (>= every request's query length) only picks the autotuned configuration."""
    if out is None:
        out = torch.empty_like(query)
    check_paged_attention_inputs(
        query, kv_cache, block_tables, seq_lens, query_start_loc, out, max_query_len, fp8_ok=True
    )
    kv_scales = kv_scale_args(k_scale, v_scale, kv_cache.device)
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = block_tables.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    check_attention_options(query, sliding_window, logits_soft_cap, sinks)

    def grid(meta: dict) -> tuple[int, int]:
        # Program ids per request: ceil(query_len / BLOCK_M) plus at most one spare.
        return (num_tokens // meta["BLOCK_M"] + num_reqs, num_heads)

    shared = paged_attention_args(
        query, kv_cache, block_tables, seq_lens, query_start_loc, out, scale=scale,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
    )  # fmt: skip
    _flash_prefill_kernel[grid](
        **shared,
        **dot_tile_args(query, kv_cache, kv_scales),
        query_len_bucket=min(next_power_of_2(max_query_len), 4096),
        HEAD_DIM_PADDED=max(16, next_power_of_2(head_dim)),
    )
    return out
