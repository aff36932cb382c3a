"""Native fp32 CPU kernels (C built at run time, called via ctypes): paged decode and
prefill attention for the `cpu` attention backend (`attention.py`), batch-1 decode through
all layers in one call, and RMSNorm, rotary embedding, SiLU-and-mul, the KV write and
argmax for the model and sampler (here). How the C is built and cached: `build.py`.

Why C and not torch: a decode step's attention reads every request's whole context, which
on the paged cache means a gather (`index_select`) into a padded copy first; on a 2-core
CPU the copy alone was a fifth of a batch-64 decode step. These kernels read the blocks in
place. The elementwise kernels each do in one call what took two to five torch ops, which
on a decode step's small tensors is mostly per-op overhead.

The GPU's kernels are Triton, in the top-level `kernels/` package (docs/architecture.md says
why there are two homes).
"""

from __future__ import annotations

import torch

from engine.native.attention import (
    DECODE_LAYER_FIELDS,
    KV_DTYPE_CODES,
    decode_scratch_floats,
    decode_token,
    kv_dtype_code,
    paged_decode_attention,
    paged_prefill_attention,
)
from engine.native.build import (
    KERNEL_CACHE_DIR_ENV,
    NATIVE_KERNELS_ENV,
    NativeKernelError,
    NoCompilerError,
    kernel_cache_dir,
    load_library,
    native_kernels_available,
)
from engine.native.moe import moe_grouped_gemm

__all__ = [
    "DECODE_LAYER_FIELDS",
    "KERNEL_CACHE_DIR_ENV",
    "KV_DTYPE_CODES",
    "NATIVE_KERNELS_ENV",
    "NativeKernelError",
    "NoCompilerError",
    "argmax",
    "decode_scratch_floats",
    "decode_token",
    "kernel_cache_dir",
    "kv_dtype_code",
    "load_library",
    "moe_grouped_gemm",
    "native_kernels_available",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_inplace",
    "silu_and_mul",
    "write_kv",
]


def rms_norm(
    x: torch.Tensor,  # [rows, cols] fp32, rows may be strided
    weight: torch.Tensor,  # [cols]
    eps: float,
    residual: torch.Tensor | None = None,  # [rows, cols]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm; with `residual`, returns (rms_norm(x + residual), x + residual)."""
    rows, cols = x.shape
    if x.stride(1) != 1 or not weight.is_contiguous() or weight.numel() != cols:
        raise ValueError(f"rms_norm: x strides {x.stride()}, weight {tuple(weight.shape)}")
    out = x.new_empty(rows, cols)
    summed = None
    if residual is not None:
        if residual.shape != x.shape or not residual.is_contiguous():
            raise ValueError(f"rms_norm: residual {tuple(residual.shape)} for x {tuple(x.shape)}")
        summed = x.new_empty(rows, cols)
    load_library().rms_norm_f32(
        out.data_ptr(),
        None if summed is None else summed.data_ptr(),
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        rows,
        cols,
        eps,
        torch.get_num_threads(),
    )
    return out if summed is None else (out, summed)


def rotary_inplace(
    x: torch.Tensor,  # [rows, num_heads, head_dim] fp32, heads contiguous, rows strided
    cos: torch.Tensor,  # [rows, 1, head_dim] (cos | cos)
    sin: torch.Tensor,  # [rows, 1, head_dim] (-sin | sin)
) -> torch.Tensor:
    """Neox rotary embedding applied in place to `x`, which is returned."""
    rows, num_heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError(f"rotary_inplace: x strides {x.stride()}")
    for table in (cos, sin):
        if table.shape != (rows, 1, head_dim) or not table.is_contiguous():
            raise ValueError(f"rotary_inplace: cos/sin {tuple(table.shape)} for x {tuple(x.shape)}")
    load_library().rotary_inplace_f32(
        x.data_ptr(),
        x.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        rows,
        num_heads,
        head_dim,
        torch.get_num_threads(),
    )
    return x


def write_kv(
    key: torch.Tensor,  # [rows, num_kv_heads, head_dim] fp32, heads contiguous, rows strided
    value: torch.Tensor,  # same shape and strides as key
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] fp32/bf16/fp16
    slot_mapping: torch.Tensor,  # [>= rows] int64, -1 = skip
) -> None:
    """Scatters each row's keys and values into its cache slot, rounded (to nearest even,
    as torch's `.to()`) where the cache is bf16 or fp16."""
    rows, num_kv_heads, head_dim = key.shape
    row = num_kv_heads * head_dim
    if (
        key.dtype != torch.float32
        or value.dtype != torch.float32
        or value.shape != key.shape
        or value.stride() != key.stride()
        or key.stride(2) != 1
        or key.stride(1) != head_dim
        or kv_cache.dim() != 5
        or not kv_cache.is_contiguous()
        or kv_cache.shape[3] * kv_cache.shape[4] != row
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
        or slot_mapping.numel() < rows
    ):
        raise ValueError("write_kv: unsupported shapes, strides or dtypes")
    code = kv_dtype_code(kv_cache)
    load_library().write_kv_f32(
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        key.stride(0),
        slot_mapping.data_ptr(),
        rows,
        row,
        code,
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [rows, 2 * inter] -> [rows, inter]
    """silu(gate) * up over (gate | up) rows, one pass; rows of x may be strided."""
    rows, width = x.shape
    if x.dtype != torch.float32 or x.stride(1) != 1 or width % 2:
        raise ValueError(f"silu_and_mul: x {tuple(x.shape)} {x.dtype} strides {x.stride()}")
    out = x.new_empty(rows, width // 2)
    load_library().silu_and_mul_f32(
        out.data_ptr(), x.data_ptr(), x.stride(0), rows, width // 2, torch.get_num_threads()
    )
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:  # [rows, cols] fp32 -> [rows] int64
    """`x.argmax(dim=-1)` (first index on ties, first NaN if any), rows over the threads:
    torch's CPU argmax runs on one thread, ≈5 ms for a [64, 49152] greedy step."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1 or x.shape[1] == 0:
        raise ValueError(f"argmax: x {tuple(x.shape)} {x.dtype} strides {x.stride()}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    load_library().argmax_rows_f32(
        out.data_ptr(), x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], torch.get_num_threads()
    )
    return out
