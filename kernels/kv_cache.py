"""Scatter of a step's new keys and values into the paged KV cache.

Token `t` goes to flat slot `slot_mapping[t] = block_id * block_size + offset`::

    slot_mapping: [ 35, -1, 112 ]          (block_size 16)
    token 0 -> kv_cache[:, 2, 3]           (35 = 2 * 16 + 3)
    token 1 -> skipped                     (-1 = padding)
    token 2 -> kv_cache[:, 7, 0]

Grid: one program per token; it copies all KV heads of that token's key and value
([num_kv_heads, head_dim] tiles) in one go, converted to the cache's dtype (the model dtype,
or a 16-bit `kv_cache_dtype`: rounded to nearest even on the store). An FP8 (E4M3) cache holds
`clamp(x / scale, -448, 448)` rounded to E4M3 (per-tensor `k_scale` / `v_scale`, vLLM's
scheme); the rounding is done in fp32 first so the cast is exact (kernels/fp8_quant.py).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels._common import (
    FLOAT_DTYPES,
    FP8_CACHE_DTYPE,
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
from kernels.fp8_quant import kv_scale_value, quantize_e4m3


@triton.jit
def cache_slot_offsets(
    slot,  # int64, a flat slot: block_id * BLOCK_SIZE + offset
    heads,  # [HEADS] KV heads
    dims,  # [DIMS] element indices inside a head
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,  # int, tokens per cache block
):
    """[HEADS, DIMS] element offsets of `slot`'s heads in kv_cache[0] (or kv_cache[1])."""
    # int64 throughout: slot * head stride overflows 32 bits on large caches.
    return (
        (slot // BLOCK_SIZE) * stride_cache_block
        + (slot % BLOCK_SIZE) * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (kv_cache[0])
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (kv_cache[1])
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    k_scale,  # FP8 cache: the keys' scale (a float, or a pointer when SCALE_IS_PTR)
    v_scale,  # FP8 cache: the values' scale
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,  # int
    HEADS_PADDED: tl.constexpr,  # int, power of two >= NUM_KV_HEADS
    HEAD_DIM: tl.constexpr,  # int
    HEAD_DIM_PADDED: tl.constexpr,  # int, power of two >= HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # int, tokens per cache block
    IS_FP8: tl.constexpr,  # bool, the cache is E4M3: store clamp(x / scale) rounded
    SCALE_IS_PTR: tl.constexpr,  # bool, k_scale / v_scale are 1-element tensors
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)  # int64
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    cache_offsets = cache_slot_offsets(
        slot, heads, dims, stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_SIZE
    )  # [HEADS_PADDED, HEAD_DIM_PADDED]
    key_offsets = token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :]
    value_offsets = token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :]
    cache_dtype = key_cache_ptr.dtype.element_ty
    key = tl.load(key_ptr + key_offsets, mask=mask)
    value = tl.load(value_ptr + value_offsets, mask=mask)
    if IS_FP8:
        key = quantize_e4m3(key, kv_scale_value(k_scale, SCALE_IS_PTR))
        value = quantize_e4m3(value, kv_scale_value(v_scale, SCALE_IS_PTR))
    key = key.to(cache_dtype)
    value = value.to(cache_dtype)
    tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


def cache_write_args(
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (kv_cache[0])
    value_cache: torch.Tensor,  # kv_cache[1]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    kv_scales: tuple[float | torch.Tensor, float | torch.Tensor, bool],  # kv_scale_args'
) -> dict[str, Any]:
    """The launch arguments of a kernel that writes `value` (and keys) into the cache at
    `slot_mapping`: `write_kv_cache`'s and `rotary_write_kv_cache`'s (kernels/rotary_kv.py)."""
    k_arg, v_arg, k_is_ptr = kv_scales
    return {
        "value_ptr": value,
        "key_cache_ptr": key_cache,
        "value_cache_ptr": value_cache,
        "slot_mapping_ptr": slot_mapping,
        "k_scale": k_arg,
        "v_scale": v_arg,
        "stride_value_token": value.stride(0),
        "stride_value_head": value.stride(1),
        "stride_cache_block": key_cache.stride(0),
        "stride_cache_slot": key_cache.stride(1),
        "stride_cache_head": key_cache.stride(2),
        "BLOCK_SIZE": key_cache.shape[1],
        "IS_FP8": key_cache.dtype == FP8_CACHE_DTYPE,
        "SCALE_IS_PTR": k_is_ptr,
    }


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding
    *,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """Writes `key`/`value` into `kv_cache` in place at `slot_mapping`; -1 slots are skipped.

    `key` and `value` may be strided views (e.g. slices of a fused QKV projection) as long as
    their last dimension is contiguous. They are in the model dtype; the cache is in it too, or
    in a 16-bit `kv_cache_dtype` they are rounded to, or in float8_e4m3fn: then each stored
    element is `clamp(x / k_scale, -448, 448)` (`v_scale` for values) rounded to E4M3, as
    torch's `(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)`; the scales (a
    float or a 1-element tensor) are ignored by other caches. Slots must be
    < num_blocks * block_size (not checked on the device).
    """
    check_kv_cache(kv_cache, fp8_ok=True)
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    for name, tensor in (("key", key), ("value", value)):
        check_ndim(name, tensor, 3, "[num_tokens, num_kv_heads, head_dim]")
        check_last_dim_contiguous(name, tensor)
        check_dtype(name, tensor, FLOAT_DTYPES)
        if not cache_dtype_fits(kv_cache.dtype, tensor.dtype, fp8_ok=True):
            raise ValueError(
                f"{name} dtype {tensor.dtype} does not fit kv_cache dtype {kv_cache.dtype}: "
                "the cache is in the model dtype or a 16-bit kv_cache_dtype."
            )
        if tensor.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match kv_cache, "
                f"got {tuple(tensor.shape)}."
            )
    check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    check_contiguous("slot_mapping", slot_mapping)
    num_tokens = slot_mapping.shape[0]
    if key.shape[0] != num_tokens or value.shape[0] != num_tokens:
        raise ValueError(
            f"key, value and slot_mapping need the same number of tokens, got "
            f"{key.shape[0]}, {value.shape[0]} and {num_tokens}."
        )
    check_same_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)
    kv_scales = kv_scale_args(k_scale, v_scale, kv_cache.device)
    if num_tokens == 0:
        return

    heads_padded = next_power_of_2(num_kv_heads)
    head_dim_padded = next_power_of_2(head_dim)
    _write_kv_cache_kernel[(num_tokens,)](
        **cache_write_args(value, kv_cache[0], kv_cache[1], slot_mapping, kv_scales),
        key_ptr=key,
        stride_key_token=key.stride(0),
        stride_key_head=key.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PADDED=heads_padded,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        num_warps=4 if heads_padded * head_dim_padded <= 2048 else 8,
    )
