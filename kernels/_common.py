"""Checks shared by the kernel launchers.

Every launcher validates its inputs on the host before launching: a kernel that reads a
tensor with a layout it does not expect computes garbage silently, so a wrong dtype, device
or stride is a `ValueError` that names the argument.
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1); Triton tile sizes must be powers of two."""
    return 1 << (max(n, 1) - 1).bit_length()


def check_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name} must have dtype in ({names}), got {tensor.dtype}.")


def check_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(tensor.shape)}.")


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    if tensor.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension, got strides {tensor.stride()}."
        )


def check_contiguous(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}.")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}.")
    device = next(iter(devices.values()))
    if device.type != "cuda" and not is_interpreter():
        raise ValueError(
            f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got device {device}."
        )


def cache_dtype_fits(cache_dtype: torch.dtype, model_dtype: torch.dtype) -> bool:
    """Whether a kernel takes a KV cache of `cache_dtype` with activations of `model_dtype`:
    the same dtype, or a 16-bit cache (`kv_cache_dtype`) that is rounded into on writes and
    converted back to the model dtype on reads."""
    return cache_dtype == model_dtype or cache_dtype in (torch.float16, torch.bfloat16)


def check_kv_cache(kv_cache: torch.Tensor) -> None:
    """Asserts the per-layer cache layout [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    check_ndim("kv_cache", kv_cache, 5, "[2, num_blocks, block_size, num_kv_heads, head_dim]")
    if kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache dim 0 must be 2 (keys, values), got shape {tuple(kv_cache.shape)}."
        )
    check_contiguous("kv_cache", kv_cache)
    check_dtype("kv_cache", kv_cache, FLOAT_DTYPES)
