"""The host-side input checks of the paged-attention launcher (kernels/paged_attention.py).

The kernel reads raw pointers with the strides it is given, so a query, cache, block table or
index tensor in a layout it does not expect would give wrong attention silently; every launch
checks all of them first and names the offending argument. Apart from the launcher because
it is plain torch (no Triton), the longest single piece of the launch path, and changes
whenever an argument is added, independently of the kernel's blocking.
"""

from __future__ import annotations

import torch

from kernels._common import (
    FLOAT_DTYPES,
    cache_dtype_fits,
    check_contiguous,
    check_dtype,
    check_kv_cache,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
)

MAX_HEAD_DIM = 256


def check_paged_attention_inputs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    max_query_len: int,
    *,
    fp8_ok: bool = False,
) -> None:
    """ValueError naming the argument for any input `paged_attention` cannot read as laid
    out in its docstring (shapes, dtypes, strides, devices, head counts)."""
    check_ndim("query", query, 3, "[num_tokens, num_heads, head_dim]")
    check_dtype("query", query, FLOAT_DTYPES)
    check_last_dim_contiguous("query", query)
    check_kv_cache(kv_cache, fp8_ok=fp8_ok)
    if not cache_dtype_fits(kv_cache.dtype, query.dtype, fp8_ok=fp8_ok):
        raise ValueError(
            f"kv_cache dtype {kv_cache.dtype} for a {query.dtype} query: the cache is in the "
            "query's dtype or a 16-bit kv_cache_dtype."
        )
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache head_dim {kv_cache.shape[4]} != query head_dim {head_dim}.")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}."
        )
    if head_dim % 8 != 0 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a multiple of 8 up to {MAX_HEAD_DIM}, got {head_dim}.")
    check_ndim("block_tables", block_tables, 2, "[num_reqs, max_blocks_per_req]")
    check_dtype("block_tables", block_tables, (torch.int32,))
    check_last_dim_contiguous("block_tables", block_tables)
    num_reqs = block_tables.shape[0]
    check_ndim("seq_lens", seq_lens, 1, "[num_reqs]")
    check_dtype("seq_lens", seq_lens, (torch.int32,))
    check_contiguous("seq_lens", seq_lens)
    check_ndim("query_start_loc", query_start_loc, 1, "[num_reqs + 1]")
    check_dtype("query_start_loc", query_start_loc, (torch.int32,))
    check_contiguous("query_start_loc", query_start_loc)
    if seq_lens.shape[0] != num_reqs or query_start_loc.shape[0] != num_reqs + 1:
        raise ValueError(
            f"block_tables has {num_reqs} rows, so seq_lens needs {num_reqs} entries and "
            f"query_start_loc {num_reqs + 1}; got {seq_lens.shape[0]} and "
            f"{query_start_loc.shape[0]}."
        )
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(
            f"out must match query's shape {tuple(query.shape)} and dtype {query.dtype}, "
            f"got {tuple(out.shape)} {out.dtype}."
        )
    check_last_dim_contiguous("out", out)
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}.")
    check_same_device(
        query=query,
        kv_cache=kv_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        out=out,
    )


def check_attention_options(
    query: torch.Tensor,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    sinks: torch.Tensor | None,
) -> None:
    """The optional features every attention launcher takes: a sliding window of >= 1 keys,
    a soft cap > 0, and one sink logit per query head on the query's device."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}.")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap}.")
    if sinks is not None:
        num_heads = query.shape[1]
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must be [num_heads={num_heads}], got {tuple(sinks.shape)}.")
        check_same_device(query=query, sinks=sinks)
