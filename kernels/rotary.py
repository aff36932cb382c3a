"""Rotary position embedding (neox style: rotate the two halves of each head), in place.

For a head vector x = [x1, x2] (halves of head_dim / 2) at position p::

    x1' = x1 * cos(p * inv_freq) - x2 * sin(p * inv_freq)
    x2' = x2 * cos(p * inv_freq) + x1 * sin(p * inv_freq)

which is Hugging Face Llama's `x * cos + rotate_half(x) * sin`.

cos/sin cache format (built by `build_cos_sin_cache`)::

    cos_sin_cache: [max_position, head_dim]   row p = [cos(p * inv_freq) | sin(p * inv_freq)]
                                              (first head_dim/2 columns cos, last head_dim/2 sin)

Grid: one program per token; it rotates all query heads and all key heads of the token with
one load of that position's cos/sin row. The math runs in fp32 and rounds once.
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


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    cos,  # [HALF_PADDED] fp32
    sin,  # [HALF_PADDED] fp32
    stride_token,
    stride_head,
    NUM_HEADS: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PADDED: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PADDED)
    dims = tl.arange(0, HALF_PADDED)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HALF)
    first = x_ptr + token * stride_token + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(first, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens] int32/int64
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache_ptr,  # [max_position, head_dim]: cos | sin
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    NUM_HEADS: tl.constexpr,  # int
    NUM_KV_HEADS: tl.constexpr,  # int
    HEADS_PADDED: tl.constexpr,  # int, power of two >= NUM_HEADS
    KV_HEADS_PADDED: tl.constexpr,  # int, power of two >= NUM_KV_HEADS
    HALF: tl.constexpr,  # int, head_dim // 2
    HALF_PADDED: tl.constexpr,  # int, power of two >= HALF
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PADDED)
    row = cos_sin_cache_ptr + position * (2 * HALF)
    cos = tl.load(row + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    _rotate_heads(
        query_ptr, token, cos, sin, stride_q_token, stride_q_head,
        NUM_HEADS, HEADS_PADDED, HALF, HALF_PADDED,
    )  # fmt: skip
    _rotate_heads(
        key_ptr, token, cos, sin, stride_k_token, stride_k_head,
        NUM_KV_HEADS, KV_HEADS_PADDED, HALF, HALF_PADDED,
    )  # fmt: skip


def apply_rotary(
    positions: torch.Tensor,  # [num_tokens] int32/int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos | sin
) -> None:
    """Rotates `query` and `key` in place (neox style, the whole head_dim is rotated).

    Positions must be < max_position (not checked on the device). `query`/`key` may be
    strided views as long as their last dimension is contiguous.
    """
    check_ndim("positions", positions, 1, "[num_tokens]")
    check_dtype("positions", positions, (torch.int32, torch.int64))
    check_contiguous("positions", positions)
    num_tokens = positions.shape[0]
    for name, tensor in (("query", query), ("key", key)):
        check_ndim(name, tensor, 3, "[num_tokens, heads, head_dim]")
        check_dtype(name, tensor, FLOAT_DTYPES)
        check_last_dim_contiguous(name, tensor)
        if tensor.shape[0] != num_tokens:
            raise ValueError(f"{name} has {tensor.shape[0]} tokens, positions {num_tokens}.")
    head_dim = query.shape[2]
    if key.shape[2] != head_dim or head_dim % 2 != 0:
        raise ValueError(
            f"query and key need the same even head_dim, got {query.shape[2]} and {key.shape[2]}."
        )
    check_ndim("cos_sin_cache", cos_sin_cache, 2, "[max_position, head_dim]")
    check_dtype("cos_sin_cache", cos_sin_cache, FLOAT_DTYPES)
    check_contiguous("cos_sin_cache", cos_sin_cache)
    if cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"cos_sin_cache must be [max_position, {head_dim}] (partial rotary is not "
            f"supported), got {tuple(cos_sin_cache.shape)}."
        )
    check_same_device(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    if num_tokens == 0:
        return
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    _rotary_kernel[(num_tokens,)](
        positions_ptr=positions,
        query_ptr=query,
        key_ptr=key,
        cos_sin_cache_ptr=cos_sin_cache,
        stride_q_token=query.stride(0),
        stride_q_head=query.stride(1),
        stride_k_token=key.stride(0),
        stride_k_head=key.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PADDED=next_power_of_2(num_heads),
        KV_HEADS_PADDED=next_power_of_2(num_kv_heads),
        HALF=head_dim // 2,
        HALF_PADDED=next_power_of_2(head_dim // 2),
        num_warps=4,
    )


def build_cos_sin_cache(
    inv_freq: torch.Tensor,  # [head_dim // 2] fp32
    max_position: int,
    attention_scaling: float = 1.0,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [max_position, head_dim]: cos | sin
    """Builds the cache `apply_rotary` reads: row p = [cos(p * inv_freq), sin(p * inv_freq)]
    times `attention_scaling`.

    The kernel knows no rope type: the inverse frequencies and the attention scaling of
    every type (default, linear, llama3, yarn, longrope, dynamic) come from the engine's
    one rope module (engine/layers/rope.py, `inv_freq` and
    `RopeParameters.attention_factor`). Angles are fp32 products position * inv_freq, as in
    Hugging Face; keep the fp32 `dtype` unless memory matters.
    """
    if inv_freq.ndim != 1:
        raise ValueError(f"inv_freq must be [head_dim // 2], got {tuple(inv_freq.shape)}.")
    positions = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    angles = positions[:, None] * inv_freq.float()[None, :]  # [max_position, head_dim // 2]
    cache = torch.cat([angles.cos(), angles.sin()], dim=1) * attention_scaling
    return cache.to(device=device, dtype=dtype)
