"""The int8 route of the quantized linear (quant_int8.c): activations quantized per 32-value
block to int8, integer dot products against the weight's own Q4_0 / Q4_1 / Q8_0 block
quants (AVX-512 VNNI, else AVX2 maddubs).

Its result differs from `quant_linear` (dequantize-then-matmul in fp32) by the activations'
8-bit rounding, so it is not a drop-in: engine/layers/quant_select.py offers it to the
timed trial of batched steps only after checking it on the real weight, and keeps it where
it is faster. The path follows `quant.active_isa()` ($PAGEDSERVE_QUANT_ISA), like the
greedy screen's.
"""

from __future__ import annotations

import ctypes
import enum
import functools

import torch

from engine.native.quant import QType, QuantizedWeight
from engine.native.quant import _lib as _quant_lib

INT8_QTYPES = (QType.Q4_0, QType.Q4_1, QType.Q8_0)


class Int8Isa(enum.IntEnum):
    """The route's kernels (the quantized kernels' ISA codes)."""

    NONE = 0
    AVX2 = 1  # vpmaddubsw (also AVX-512 CPUs without VNNI)
    AVX512_VNNI = 2


def int8_isa() -> Int8Isa:
    """The int8 route's kernels on this CPU under the active (or forced) quantized path."""
    isa = ctypes.c_int(0)
    _lib().quant_linear_i8_supported(int(QType.Q8_0), ctypes.byref(isa))
    return Int8Isa(isa.value)


def int8_applies(weight: QuantizedWeight) -> bool:
    """Whether `weight` can take the int8 route here (its block type, this CPU's path)."""
    return bool(_lib().quant_linear_i8_supported(int(weight.qtype), None))


def quant_linear_int8(
    x: torch.Tensor,  # [rows, in_features] fp32
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [rows, out_features] fp32
    """x @ W.T (+ bias) through the int8 route; ValueError where it does not apply."""
    if x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2:
        raise ValueError(f"quant_linear_int8 takes 2-D fp32 CPU rows, got {x.dtype} {x.dim()}-D.")
    if x.shape[1] != weight.in_features:
        raise ValueError(f"activation width {x.shape[1]} != in_features {weight.in_features}.")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    status = _lib().quant_linear_i8(
        out.data_ptr(),
        out.stride(0),
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        weight.data.data_ptr(),
        weight.data.shape[1],
        int(weight.qtype),
        weight.out_features,
        weight.in_features,
        torch.get_num_threads(),
    )
    if status == -2:
        raise ValueError(f"no int8 route for {weight.qtype.name} weights on this CPU/path.")
    if status != 0:
        raise MemoryError("quant_linear_i8 could not allocate its buffers.")
    if bias is not None:
        out += bias
    return out


_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@functools.cache
def _lib() -> ctypes.CDLL:
    """The native library (its quantized path applied) with the route's signatures set."""
    library = _quant_lib()
    library.quant_linear_i8_supported.argtypes = [_int, _ptr]
    library.quant_linear_i8_supported.restype = _int
    # out, out_stride, x, x_stride, rows, w, row_bytes, type, n_out, k, threads
    library.quant_linear_i8.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _int]
    library.quant_linear_i8.argtypes += [_i64, _i64, _int]
    library.quant_linear_i8.restype = _int
    return library
