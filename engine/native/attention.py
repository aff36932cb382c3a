"""Wrappers of the attention kernels: paged decode and prefill attention for the `cpu`
backend, and one decode token through all layers for batch-1 decode (`LlamaModel`).

Each checks the layouts the C code assumes and raises ValueError otherwise. Queries and
outputs are fp32; the KV cache is fp32, bf16 or fp16 (`kv_cache_dtype`): the kernels round
keys/values into it when writing and widen them to fp32 when reading (kv_dtype.h)."""

from __future__ import annotations

import torch

from engine.native.build import load_library

# The cache element types the kernels read and write, as the C code numbers them
# (KV_F32 / KV_BF16 / KV_F16 in kv_dtype.h).
KV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def kv_dtype_code(kv_cache: torch.Tensor) -> int:
    """The C code of the cache's dtype; a ValueError names the dtypes accepted."""
    code = KV_DTYPE_CODES.get(kv_cache.dtype)
    if code is None:
        raise ValueError(
            f"kv_cache dtype {kv_cache.dtype}: the native kernels take float32, bfloat16 "
            "or float16 caches."
        )
    return code


# Fields per layer of `decode_token`'s layer table (the enum in cpu_kernels.c).
DECODE_LAYER_FIELDS = (
    "input_norm",
    "qkv_weight",
    "qkv_bias",
    "o_weight",
    "o_bias",
    "post_norm",
    "gate_up_weight",
    "gate_up_bias",
    "down_weight",
    "down_bias",
    "key_cache",
    "value_cache",
)


def paged_decode_attention(
    query: torch.Tensor,  # [num_reqs, num_heads, head_dim] fp32, rows may be strided
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] fp32/bf16/fp16
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    max_len: int,  # >= max(seq_lens)
    scale: float,
    sliding_window: int | None = None,  # each query sees its last `sliding_window` keys
    logits_soft_cap: float | None = None,  # scores -> cap * tanh(scores / cap) (Gemma 2)
    sinks: torch.Tensor | None = None,  # [num_heads]: attention sinks (GPT-OSS)
) -> torch.Tensor:  # [num_reqs, num_heads, head_dim]
    """Attention of one query token per request over its paged context."""
    num_reqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads, cache_head_dim = kv_cache.shape[2:]
    _check(query, kv_cache, block_tables, seq_lens, num_reqs, num_heads, head_dim)
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query [{num_reqs}, {num_heads}, {head_dim}] does not fit the cache "
            f"{tuple(kv_cache.shape)}"
        )
    sinks = _sinks(sinks, num_heads, "paged_decode_attention")
    if num_reqs == 0:
        return query.new_empty(0, num_heads, head_dim)
    scores = query.new_empty(num_reqs, num_heads, max_len)  # [R, H, max_len] scratch
    out = query.new_empty(num_reqs, num_heads, head_dim)
    load_library().paged_decode_attention_f32(
        out.data_ptr(),
        query.data_ptr(),
        query.stride(0),
        scores.data_ptr(),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        num_reqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        max_len,
        sliding_window or 0,
        scale,
        logits_soft_cap or 0.0,
        None if sinks is None else sinks.data_ptr(),
        torch.get_num_threads(),
        kv_dtype_code(kv_cache),
    )
    return out


def _sinks(sinks: torch.Tensor | None, num_heads: int, caller: str) -> torch.Tensor | None:
    """The sinks as the C code reads them: a contiguous fp32 CPU vector of num_heads (a
    bf16 parameter is widened here; fp32 passes as it is)."""
    if sinks is None:
        return None
    if sinks.shape != (num_heads,) or sinks.device.type != "cpu":
        raise ValueError(
            f"{caller}: sinks {tuple(sinks.shape)} on {sinks.device}, need [{num_heads}] on the CPU"
        )
    return sinks.to(torch.float32).contiguous()


def _check(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    num_heads: int,
    head_dim: int,
) -> None:
    """The layout the C code assumes; anything else is a caller bug, reported as such."""
    problems = []
    if query.dtype != torch.float32 or kv_cache.dtype not in KV_DTYPE_CODES:
        problems.append(
            f"dtypes {query.dtype}/{kv_cache.dtype} (need a float32 query and a float32, "
            "bfloat16 or float16 cache)"
        )
    if query.device.type != "cpu" or kv_cache.device.type != "cpu":
        problems.append("tensors off the CPU")
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        problems.append(f"query strides {query.stride()}")
    if kv_cache.dim() != 5 or not kv_cache.is_contiguous():
        problems.append("kv_cache not a contiguous 5-D tensor")
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        problems.append("block_tables not int32 rows")
    if block_tables.shape[0] < num_reqs:
        problems.append(f"{block_tables.shape[0]} block-table rows for {num_reqs} requests")
    if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous() or seq_lens.numel() < num_reqs:
        problems.append("seq_lens not a contiguous int32 vector")
    if problems:
        raise ValueError("paged_decode_attention: " + "; ".join(problems))


def paged_prefill_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim] fp32, written for the prefill rows
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] fp32, rows may be strided
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] fp32/bf16/fp16
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    first_req: int,
    scale: float,
    sliding_window: int | None = None,  # each query sees its last `sliding_window` keys
    logits_soft_cap: float | None = None,  # scores -> cap * tanh(scores / cap) (Gemma 2)
    sinks: torch.Tensor | None = None,  # [num_heads]: attention sinks (GPT-OSS)
    batch_invariant: bool = False,  # each row computed alike in any chunk or batch
) -> None:
    """Causal attention of requests first_req.. (prefill chunks, any cached context) over
    their paged keys/values, which must already hold this step's tokens. `batch_invariant`:
    the kernel's variant whose rows do not depend on their chunk (cpu_kernels.c)."""
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    _check(query, kv_cache, block_tables, seq_lens, num_reqs, num_heads, head_dim)
    problems = []
    if out.dtype != torch.float32 or out.shape != query.shape or out.stride(2) != 1:
        problems.append(f"out {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    elif out.stride(1) != head_dim:
        problems.append(f"out strides {out.stride()}")
    if (
        query_start_loc.dtype != torch.int32
        or not query_start_loc.is_contiguous()
        or query_start_loc.numel() != num_reqs + 1
    ):
        problems.append("query_start_loc not a contiguous int32 vector of num_reqs + 1")
    elif int(query_start_loc[-1]) > num_tokens:
        problems.append(f"query_start_loc ends past the {num_tokens} query rows")
    if kv_cache.shape[4] != head_dim or num_heads % kv_cache.shape[3]:
        problems.append(f"query heads {num_heads}x{head_dim} vs cache {tuple(kv_cache.shape)}")
    if not 0 <= first_req <= num_reqs:
        problems.append(f"first_req {first_req} of {num_reqs}")
    if problems:
        raise ValueError("paged_prefill_attention: " + "; ".join(problems))
    sinks = _sinks(sinks, num_heads, "paged_prefill_attention")
    if first_req == num_reqs:
        return
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    library = load_library()
    kernel = (
        library.paged_prefill_attention_invariant
        if batch_invariant
        else library.paged_prefill_attention
    )
    kernel(
        out.data_ptr(),
        out.stride(0),
        query.data_ptr(),
        query.stride(0),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        query_start_loc.data_ptr(),
        seq_lens.data_ptr(),
        first_req,
        num_reqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        sliding_window or 0,
        scale,
        logits_soft_cap or 0.0,
        None if sinks is None else sinks.data_ptr(),
        torch.get_num_threads(),
        kv_dtype_code(kv_cache),
    )


def decode_scratch_floats(
    hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, inter: int, seq_len: int
) -> int:
    """Floats of scratch `decode_token` needs (see decode_token_f32 in cpu_kernels.c)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    return hidden_size + 2 * q_size + 2 * kv_size + 3 * inter + num_heads * seq_len


def decode_token(
    hidden: torch.Tensor,  # [hidden_size] fp32: the embedding in, the last MLP output out
    layers: torch.Tensor,  # [num_layers, len(DECODE_LAYER_FIELDS)] int64 addresses
    cos: torch.Tensor,  # [head_dim] (cos | cos) of the token's position
    sin: torch.Tensor,  # [head_dim] (-sin | sin)
    block_table: torch.Tensor,  # [>= ceil(seq_len / block_size)] int32
    seq_len: int,  # context length including this token
    slot: int,  # this token's cache slot
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    block_size: int,
    eps: float,
    scale: float,
    sliding_window: int | None = None,  # every layer's, or None
    kv_cache_dtype: torch.dtype = torch.float32,  # every layer's cache
) -> torch.Tensor:  # [hidden_size]: the residual stream before the last MLP
    """All decoder layers for one decode token, in place on `hidden` (cpu_kernels.c).

    The caller guarantees what the addresses in `layers` point at: fp32 contiguous weights
    [out, in] of the sizes given, and caches [num_blocks, block_size, Hkv, D] of
    `kv_cache_dtype` holding `slot` and the blocks of `block_table`. The shapes passed here
    are checked."""
    hidden_size = hidden.shape[0]
    problems = []
    for name, t in (("hidden", hidden), ("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            problems.append(f"{name} not a contiguous fp32 CPU tensor")
    if cos.numel() != head_dim or sin.numel() != head_dim or head_dim % 2:
        problems.append(f"cos/sin of {cos.numel()}/{sin.numel()} for head_dim {head_dim}")
    if layers.dtype != torch.int64 or layers.dim() != 2 or not layers.is_contiguous():
        problems.append("layers not a contiguous int64 table")
    elif layers.shape[1] != len(DECODE_LAYER_FIELDS):
        problems.append(f"layers has {layers.shape[1]} fields")
    if block_table.dtype != torch.int32 or not block_table.is_contiguous():
        problems.append("block_table not contiguous int32")
    elif block_table.numel() * block_size < seq_len or seq_len <= 0:
        problems.append(f"block_table of {block_table.numel()} blocks for {seq_len} tokens")
    if num_heads % num_kv_heads:
        problems.append(f"{num_heads} heads for {num_kv_heads} KV heads")
    if kv_cache_dtype not in KV_DTYPE_CODES:
        problems.append(f"kv_cache_dtype {kv_cache_dtype}")
    if problems:
        raise ValueError("decode_token: " + "; ".join(problems))
    residual = torch.empty_like(hidden)
    scratch = hidden.new_empty(
        decode_scratch_floats(
            hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, seq_len
        )
    )
    load_library().decode_token_f32(
        hidden.data_ptr(),
        residual.data_ptr(),
        layers.data_ptr(),
        layers.shape[0],
        scratch.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        block_table.data_ptr(),
        seq_len,
        slot,
        hidden_size,
        num_heads,
        num_kv_heads,
        head_dim,
        intermediate_size,
        block_size,
        sliding_window or 0,
        eps,
        scale,
        torch.get_num_threads(),
        KV_DTYPE_CODES[kv_cache_dtype],
    )
    return residual
