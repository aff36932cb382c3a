"""The batch-invariant native linear: `invariant_linear` (EngineArgs `batch_invariant`).

`quant_linear` picks its kernel by the number of activation rows (row kernels up to
`GEMV_MAX_ROWS`, the dequantize-GEMM above) and the row kernels pick their reduction by
it too, so a row's sums round differently alone than in a batch. `invariant_linear` calls
`quant_linear_invariant_f32` (quant_kernels.c), which computes out[r, n] with one fixed
reduction over k whatever the row count or the row's place in the batch, threads split
over output rows only. It takes every weight `quant_linear` takes, fp32 ones included
(`fp32_weight`), so one kernel serves the projections and the LM head.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.native.build import load_library
from engine.native.quant import QuantizedWeight, active_isa

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@functools.cache
def _kernel() -> ctypes._CFuncPtr:
    active_isa()  # applies $PAGEDSERVE_QUANT_ISA, as every quantized kernel call does
    function = load_library().quant_linear_invariant_f32
    # out, out_stride, x, x_stride, rows, w, row_bytes, scales, type, n_out, k, threads
    function.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, _int, _i64, _i64, _int]
    function.restype = _int
    return function


def invariant_linear(
    x: torch.Tensor,  # [..., in_features] fp32 CPU
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [..., out_features] fp32
    """x @ W.T (+ bias), each output row computed alike in any batch (see the module doc)."""
    if x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(
            f"invariant_linear takes fp32 CPU activations, got {x.dtype} on {x.device}."
        )
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"activation width {x.shape[-1]} != in_features {weight.in_features}.")
    x2 = x.reshape(-1, weight.in_features)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, weight.out_features, dtype=torch.float32)
    if rows:
        status = _kernel()(
            out.data_ptr(),
            out.stride(0),
            x2.data_ptr(),
            x2.stride(0),
            rows,
            weight.data.data_ptr(),
            weight.data.shape[1],
            None if weight.scales is None else weight.scales.data_ptr(),
            int(weight.qtype),
            weight.out_features,
            weight.in_features,
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("quant_linear_invariant_f32 could not allocate its buffers.")
    if bias is not None:
        out += bias  # elementwise: the same for every row
    return out.reshape(*x.shape[:-1], weight.out_features)
