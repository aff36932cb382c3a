"""The keyword arguments the paged attention launchers share.

`paged_attention`, `flash_prefill` and `invariant_attention` launch kernels that read the
same inputs the same way (kernels/paged_kv_tiles.py's tile pieces), so their launches pass
the same pointers, strides, scales and feature constexprs::

    _kernel[grid](
        **paged_attention_args(query, kv_cache, ...),   # all three kernels
        **dot_tile_args(query, kv_cache, kv_scales),    # the tl.dot kernels (FP8 cache too)
        ...                                             # the launcher's own: tiles, splits
    )

The batch-invariant kernel takes only the first group: it has no `tl.dot` and reads no FP8
cache, so it takes neither `DOT_PRECISION` / `UPCAST` nor the scales.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels._common import FP8_CACHE_DTYPE, dot_precision, is_interpreter
from kernels.paged_kv_tiles import LOG2_E


def paged_attention_args(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    *,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    sinks: torch.Tensor | None,
) -> dict[str, Any]:
    """Inputs, output, strides and the causal-mask and score options of one launch, under
    the argument names every paged attention kernel uses (inputs already checked)."""
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    return {
        "query_ptr": query,
        "key_cache_ptr": key_cache,
        "value_cache_ptr": value_cache,
        "block_tables_ptr": block_tables,
        "seq_lens_ptr": seq_lens,
        "query_start_loc_ptr": query_start_loc,
        "out_ptr": out,
        "scale_log2": scale * LOG2_E,
        "soft_cap_log2": (logits_soft_cap or 1.0) * LOG2_E,
        "sinks_ptr": out if sinks is None else sinks,  # never read without sinks
        "num_reqs": block_tables.shape[0],
        "stride_q_token": query.stride(0),
        "stride_q_head": query.stride(1),
        "stride_cache_block": key_cache.stride(0),
        "stride_cache_slot": key_cache.stride(1),
        "stride_cache_head": key_cache.stride(2),
        "stride_bt_req": block_tables.stride(0),
        "stride_out_token": out.stride(0),
        "stride_out_head": out.stride(1),
        "QUERIES_PER_KV": query.shape[1] // kv_cache.shape[3],
        "BLOCK_SIZE": kv_cache.shape[2],
        "HEAD_DIM": query.shape[2],
        "SLIDING_WINDOW": sliding_window or 0,
        "HAS_SOFT_CAP": logits_soft_cap is not None,
        "HAS_SINKS": sinks is not None,
    }


def dot_tile_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scales: tuple[float | torch.Tensor, float | torch.Tensor, bool],  # kv_scale_args'
) -> dict[str, Any]:
    """The `tl.dot` precision and the FP8 cache's scales (kernels/_common.py's
    `kv_scale_args` result: keys', values', whether they are pointers)."""
    k_arg, v_arg, k_is_ptr = kv_scales
    return {
        "k_scale": k_arg,
        "v_scale": v_arg,
        "UPCAST": is_interpreter() and query.dtype == torch.bfloat16,
        "DOT_PRECISION": dot_precision(query.dtype),
        "IS_FP8": kv_cache.dtype == FP8_CACHE_DTYPE,
        "SCALE_IS_PTR": k_is_ptr,
    }
