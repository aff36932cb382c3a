"""Rotary embedding of q and k from the engine's per-token cos/sin, in one launch, optionally
fused with the KV-cache write.

The engine computes each forward's cos/sin once, for every rope type (default, linear,
llama3, yarn, longrope, dynamic: engine/layers/rope.py; the scaling only changes the table
and the attention factor folded into it), and every layer rotates with them. This kernel
reads them in the engine's form, so one kernel serves every type::

    cos: [num_tokens, 1, head_dim]   (c | c)      c = cos(angle) * attention_factor
    sin: [num_tokens, 1, head_dim]   (-s | s)     s = sin(angle) * attention_factor

    x = [x1 | x2]  ->  [x1 * c - x2 * s | x2 * c + x1 * s]   (neox: rotate the two halves)

The heads to rotate are one [num_tokens, num_heads + num_kv_heads, head_dim] view: q and k
are adjacent heads of the fused QKV projection's output, so both turn in one launch, in
place. `rotary_write_kv_cache` also stores the rotated keys and the values into the paged
cache at `slot_mapping` (kernels/kv_cache.py's layout), which saves the write's own launch
and its re-read of the keys on every layer.

Grid: one program per token; it loads the token's cos/sin half rows once and turns all its
heads as one [heads, head_dim / 2] tile pair. The math runs in fp32 and rounds once to the
model dtype; the cache gets that rounded key (converted to a 16-bit `kv_cache_dtype` if the
cache has one), bit for bit what `write_kv_cache` would store after a separate rotation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    FLOAT_DTYPES,
    cache_dtype_fits,
    check_contiguous,
    check_dtype,
    check_kv_cache,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    kv_scale_args,
    next_power_of_2,
)
from kernels.fp8_quant import kv_scale_values, quantize_e4m3
from kernels.kv_cache import cache_slot_offsets, cache_write_args


@triton.jit
def _rotary_kv_kernel(
    qk_ptr,  # [num_tokens, num_heads + num_kv_heads, head_dim], rotated in place
    cos_ptr,  # [num_tokens, 1, head_dim]: (c | c); the first half is read
    sin_ptr,  # [num_tokens, 1, head_dim]: (-s | s); the second half is read
    value_ptr,  # [num_tokens, num_kv_heads, head_dim] (read when WRITE_KV)
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (when WRITE_KV)
    value_cache_ptr,  # same layout, kv_cache[1]
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip (when WRITE_KV)
    k_scale,  # FP8 cache: the keys' scale (a float, or a pointer when SCALE_IS_PTR)
    v_scale,  # FP8 cache: the values' scale
    stride_qk_token,
    stride_qk_head,
    stride_cos_token,
    stride_sin_token,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_HEADS: tl.constexpr,  # int, query heads (the first heads of qk)
    NUM_KV_HEADS: tl.constexpr,  # int, key heads (the last heads of qk)
    HEADS_PADDED: tl.constexpr,  # int, power of two >= NUM_HEADS
    KV_HEADS_PADDED: tl.constexpr,  # int, power of two >= NUM_KV_HEADS
    HALF: tl.constexpr,  # int, head_dim // 2
    HALF_PADDED: tl.constexpr,  # int, power of two >= HALF
    BLOCK_SIZE: tl.constexpr,  # int, tokens per cache block (when WRITE_KV)
    WRITE_KV: tl.constexpr,  # bool, store the rotated keys and the values into the cache
    IS_FP8: tl.constexpr,  # bool, the cache is E4M3: store clamp(x / scale) rounded
    SCALE_IS_PTR: tl.constexpr,  # bool, k_scale / v_scale are 1-element tensors
):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF_PADDED)
    dim_valid = dims < HALF
    cos = tl.load(cos_ptr + token * stride_cos_token + dims, mask=dim_valid, other=0.0)
    sin = tl.load(sin_ptr + token * stride_sin_token + HALF + dims, mask=dim_valid, other=0.0)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]
    dtype = qk_ptr.dtype.element_ty

    heads = tl.arange(0, HEADS_PADDED)
    mask = (heads[:, None] < NUM_HEADS) & dim_valid[None, :]
    first = qk_ptr + token * stride_qk_token + heads[:, None] * stride_qk_head + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)  # [HEADS_PADDED, HALF_PADDED]
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)

    kv_heads = tl.arange(0, KV_HEADS_PADDED)
    kv_mask = (kv_heads[:, None] < NUM_KV_HEADS) & dim_valid[None, :]
    k_first = (
        qk_ptr
        + token * stride_qk_token
        + (NUM_HEADS + kv_heads[:, None]) * stride_qk_head
        + dims[None, :]
    )
    k1 = tl.load(k_first, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_first + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    out1 = (k1 * cos - k2 * sin).to(dtype)  # [KV_HEADS_PADDED, HALF_PADDED]
    out2 = (k2 * cos + k1 * sin).to(dtype)
    tl.store(k_first, out1, mask=kv_mask)
    tl.store(k_first + HALF, out2, mask=kv_mask)

    if WRITE_KV:
        slot = tl.load(slot_mapping_ptr + token)  # int64
        if slot >= 0:
            # [KV_HEADS_PADDED, HALF_PADDED]
            cache_offsets = cache_slot_offsets(
                slot, kv_heads, dims, stride_cache_block, stride_cache_slot, stride_cache_head,
                BLOCK_SIZE,
            )  # fmt: skip
            # An FP8 cache quantizes the rounded model-dtype keys, as write_kv_cache does.
            cache_dtype = key_cache_ptr.dtype.element_ty
            ks, vs = kv_scale_values(k_scale, v_scale, IS_FP8, SCALE_IS_PTR)
            k_cache1 = out1
            k_cache2 = out2
            if IS_FP8:
                k_cache1 = quantize_e4m3(out1, ks)
                k_cache2 = quantize_e4m3(out2, ks)
            tl.store(key_cache_ptr + cache_offsets, k_cache1.to(cache_dtype), mask=kv_mask)
            tl.store(key_cache_ptr + cache_offsets + HALF, k_cache2.to(cache_dtype), mask=kv_mask)
            v_first = (
                value_ptr
                + token * stride_value_token
                + kv_heads[:, None] * stride_value_head
                + dims[None, :]
            )
            v1 = tl.load(v_first, mask=kv_mask, other=0.0)
            v2 = tl.load(v_first + HALF, mask=kv_mask, other=0.0)
            if IS_FP8:
                v1 = quantize_e4m3(v1, vs)
                v2 = quantize_e4m3(v2, vs)
            v1 = v1.to(cache_dtype)
            v2 = v2.to(cache_dtype)
            tl.store(value_cache_ptr + cache_offsets, v1, mask=kv_mask)
            tl.store(value_cache_ptr + cache_offsets + HALF, v2, mask=kv_mask)


def _check_rotary_inputs(
    qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
) -> None:
    check_ndim("qk", qk, 3, "[num_tokens, num_heads + num_kv_heads, head_dim]")
    check_dtype("qk", qk, FLOAT_DTYPES)
    check_last_dim_contiguous("qk", qk)
    num_tokens, num_qk_heads, head_dim = qk.shape
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even, got {head_dim}.")
    if not 0 <= num_heads < num_qk_heads:
        raise ValueError(f"num_heads must be in [0, {num_qk_heads}), got {num_heads}.")
    for name, tensor in (("cos", cos), ("sin", sin)):
        check_ndim(name, tensor, 3, "[num_tokens, 1, head_dim]")
        check_dtype(name, tensor, FLOAT_DTYPES)
        check_last_dim_contiguous(name, tensor)
        if tensor.shape != (num_tokens, 1, head_dim):
            raise ValueError(
                f"{name} must be [{num_tokens}, 1, {head_dim}] (the engine's cos_sin form), "
                f"got {tuple(tensor.shape)}."
            )


def _launch(
    qk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    value: torch.Tensor,
    kv_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float | torch.Tensor, float | torch.Tensor, bool] = (1.0, 1.0, False),
) -> None:
    num_tokens, num_qk_heads, head_dim = qk.shape
    if num_tokens == 0:
        return
    num_kv_heads = num_qk_heads - num_heads
    # Without WRITE_KV nothing of the cache is read or written: qk stands in for it (and
    # its head count for BLOCK_SIZE, a constexpr of no use then).
    key_cache = value_cache = qk
    if kv_cache is not None:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
    heads_padded = next_power_of_2(max(num_heads, 1))
    _rotary_kv_kernel[(num_tokens,)](
        **cache_write_args(value, key_cache, value_cache, slot_mapping, kv_scales),
        qk_ptr=qk,
        cos_ptr=cos,
        sin_ptr=sin,
        stride_qk_token=qk.stride(0),
        stride_qk_head=qk.stride(1),
        stride_cos_token=cos.stride(0),
        stride_sin_token=sin.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PADDED=heads_padded,
        KV_HEADS_PADDED=next_power_of_2(num_kv_heads),
        HALF=head_dim // 2,
        HALF_PADDED=next_power_of_2(head_dim // 2),
        WRITE_KV=kv_cache is not None,
        num_warps=4 if heads_padded * head_dim <= 4096 else 8,
    )


def rotary_cos_sin_(
    qk: torch.Tensor,  # [num_tokens, num_qk_heads, head_dim], rotated in place
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]: (c | c)
    sin: torch.Tensor,  # [num_tokens, 1, head_dim]: (-s | s)
) -> torch.Tensor:  # qk
    """Rotates every head of `qk` in place (the signature of the engine's `rotate_`) and
    returns it. `qk` may be a strided view (q | k heads of the QKV output) whose last
    dimension is contiguous."""
    _check_rotary_inputs(qk, cos, sin, 0)
    check_same_device(qk=qk, cos=cos, sin=sin)
    # All heads as "key heads" of a launch with no query heads and no cache.
    _launch(qk, cos, sin, 0, qk, None, qk)
    return qk


def rotary_write_kv_cache(
    qk: torch.Tensor,  # [num_tokens, num_heads + num_kv_heads, head_dim], rotated in place
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]: (c | c)
    sin: torch.Tensor,  # [num_tokens, 1, head_dim]: (-s | s)
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding
    num_heads: int,
    *,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """Rotates q (the first `num_heads` heads of `qk`) and k (the rest) in place, then writes
    the rotated keys and `value` into `kv_cache` at `slot_mapping` (-1 slots are skipped):
    `rotary_cos_sin_` followed by `write_kv_cache`, in one launch (an FP8 cache quantized
    with `k_scale` / `v_scale` as there)."""
    _check_rotary_inputs(qk, cos, sin, num_heads)
    check_kv_cache(kv_cache, fp8_ok=True)
    num_tokens, num_qk_heads, head_dim = qk.shape
    num_kv_heads = num_qk_heads - num_heads
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}.")
    if kv_cache.shape[3:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache holds {tuple(kv_cache.shape[3:])} per slot, qk's keys are "
            f"({num_kv_heads}, {head_dim})."
        )
    check_ndim("value", value, 3, "[num_tokens, num_kv_heads, head_dim]")
    check_last_dim_contiguous("value", value)
    if value.shape != (num_tokens, num_kv_heads, head_dim) or value.dtype != qk.dtype:
        raise ValueError(
            f"value must be [{num_tokens}, {num_kv_heads}, {head_dim}] {qk.dtype}, "
            f"got {tuple(value.shape)} {value.dtype}."
        )
    if not cache_dtype_fits(kv_cache.dtype, qk.dtype, fp8_ok=True):
        raise ValueError(
            f"qk dtype {qk.dtype} does not fit kv_cache dtype {kv_cache.dtype}: the cache is "
            "in the model dtype or a 16-bit kv_cache_dtype."
        )
    check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    check_contiguous("slot_mapping", slot_mapping)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} tokens, qk {num_tokens}.")
    check_same_device(
        qk=qk, value=value, cos=cos, sin=sin, kv_cache=kv_cache, slot_mapping=slot_mapping
    )
    kv_scales = kv_scale_args(k_scale, v_scale, kv_cache.device)
    _launch(qk, cos, sin, num_heads, value, kv_cache, slot_mapping, kv_scales)
