"""Checks shared by the kernel launchers.

Every launcher validates its inputs on the host before launching: a kernel that reads a
tensor with a layout it does not expect computes garbage silently, so a wrong dtype, device
or stride is a `ValueError` that names the argument.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_CACHE_DTYPE = torch.float8_e4m3fn  # an FP8 KV cache: per-tensor scaled (kv_cache_dtype="fp8")


def is_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1); Triton tile sizes must be powers of two."""
    return 1 << (max(n, 1) - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str | None:
    """`tl.dot`'s input_precision for operands of `dtype`: fp32 in, fp32-exact dots ("ieee";
    tf32 would cost ~3 decimal digits); the default for the 16-bit dtypes."""
    return "ieee" if dtype == torch.float32 else None


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


def cache_dtype_fits(
    cache_dtype: torch.dtype, model_dtype: torch.dtype, *, fp8_ok: bool = False
) -> bool:
    """Whether a kernel takes a KV cache of `cache_dtype` with activations of `model_dtype`:
    the same dtype, or a 16-bit cache (`kv_cache_dtype`) that is rounded into on writes and
    converted back to the model dtype on reads, or (`fp8_ok`: kernels that scale) an FP8 one."""
    if fp8_ok and cache_dtype == FP8_CACHE_DTYPE:
        return True
    return cache_dtype == model_dtype or cache_dtype in (torch.float16, torch.bfloat16)


def check_kv_cache(kv_cache: torch.Tensor, *, fp8_ok: bool = False) -> None:
    """Asserts the per-layer cache layout [2, num_blocks, block_size, num_kv_heads, head_dim]
    (an FP8 element type only for kernels that scale it: `fp8_ok`)."""
    check_ndim("kv_cache", kv_cache, 5, "[2, num_blocks, block_size, num_kv_heads, head_dim]")
    if kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache dim 0 must be 2 (keys, values), got shape {tuple(kv_cache.shape)}."
        )
    check_contiguous("kv_cache", kv_cache)
    check_dtype("kv_cache", kv_cache, FLOAT_DTYPES + ((FP8_CACHE_DTYPE,) if fp8_ok else ()))


def kv_scale_arg(name: str, scale: float | torch.Tensor, device: torch.device):
    """An FP8 KV cache's per-tensor scale as a kernel argument: (value or pointer, whether it
    is a pointer). A float is passed by value; a tensor (1 element, any float dtype, on the
    cache's device) is read on the device, so the launch never synchronizes."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.is_floating_point():
            raise ValueError(f"{name} must be a float or a 1-element float tensor.")
        if scale.device != device:
            raise ValueError(f"{name} must be on the cache's device {device}, got {scale.device}.")
        return scale, True
    scale = float(scale)
    if not scale > 0.0 or scale == float("inf"):
        raise ValueError(f"{name} must be positive and finite, got {scale}.")
    return scale, False


def kv_scale_args(
    k_scale: float | torch.Tensor, v_scale: float | torch.Tensor, device: torch.device
):
    """Both scales of an FP8 KV cache as kernel arguments: (keys', values', whether they are
    pointers); both floats or both tensors."""
    k_arg, k_is_ptr = kv_scale_arg("k_scale", k_scale, device)
    v_arg, v_is_ptr = kv_scale_arg("v_scale", v_scale, device)
    if k_is_ptr != v_is_ptr:
        raise ValueError("k_scale and v_scale must both be floats or both tensors.")
    return k_arg, v_arg, k_is_ptr


def even_k(args: dict) -> bool:
    """The `EVEN_K` heuristic of the GEMM kernels: K is a whole number of `BLOCK_K` steps, so
    the K loop's loads need no mask on K."""
    return args["K"] % args["BLOCK_K"] == 0


def launch_tuned(
    autotuned: Any, kernel: Any, grid: Callable[[dict], tuple], args: dict, config: Any
) -> Any:
    """Runs a GEMM kernel: `autotuned` (the GPU times its candidates and keeps the best per
    key) when `config` is None, else `kernel` with `config` (a dataclass with `triton()`,
    `num_warps`, `num_stages`: the tests' and benchmarks' explicit tile). Returns the
    `triton.Config` that ran."""
    if config is None:
        autotuned[grid](**args)
        return autotuned.best_config
    tc = config.triton()
    kernel[grid(tc.kwargs)](
        **args, **tc.kwargs, num_warps=config.num_warps, num_stages=config.num_stages
    )
    return tc
