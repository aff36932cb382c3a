"""Weights kept quantized (GGUF blocks, per-channel int8) and the native linear on them.

A `QuantizedWeight` holds a [out_features, in_features] matrix in its storage format: GGUF
Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K block bytes exactly as the file stores them (one row of
blocks per output row, since GGUF blocks run along the input dimension), or int8 values
with one fp32 scale per output row. `quant_linear` multiplies fp32 activations by it in
quant_kernels.c with fp32 accumulation, so its result is that of `dequantize()` up to
summation order.

Up to `GEMV_MAX_ROWS` activation rows (small decode steps) the weight bytes read are the
cost, and row kernels dequantize each weight row once for all the activation rows. Above
that (batched decode steps, prefill) the work is compute-bound and quant_gemm.c's GEMM
takes over: it dequantizes 16 output rows x 256 values at a time into a per-thread L1
buffer and multiplies them into every activation row's sums in register tiles, so the fp32
weight is never materialised and each weight value is dequantized once per call (per
chunk of about 1 MiB of activations), not once per row.

The kernels' ISA path (portable C, AVX2+FMA, AVX-512) is the widest this CPU runs unless
``$PAGEDSERVE_QUANT_ISA`` (``portable``, ``avx2``, ``avx512``) or `set_isa` forces one.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import os
from dataclasses import dataclass

import torch

from engine.native.build import load_library

QUANT_ISA_ENV = "PAGEDSERVE_QUANT_ISA"
# Above this many activation rows the dequantize-GEMM (quant_gemm_f32) is used.
GEMV_MAX_ROWS = 16


class QType(enum.IntEnum):
    """Storage formats: ggml's type ids, and our own for per-channel int8. F32 is a plain
    fp32 weight viewed as bytes (`fp32_weight`): the same kernels on unquantized layers."""

    F32 = 0
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q6_K = 14
    INT8 = 1024


# (values per block, bytes per block)
BLOCK_SIZES: dict[QType, tuple[int, int]] = {
    QType.F32: (1, 4),
    QType.Q4_0: (32, 18),
    QType.Q4_1: (32, 20),
    QType.Q8_0: (32, 34),
    QType.Q4_K: (256, 144),
    QType.Q6_K: (256, 210),
    QType.INT8: (1, 1),
}


class Isa(enum.IntEnum):
    PORTABLE = 0
    AVX2 = 1
    AVX512 = 2


@dataclass(frozen=True)
class QuantizedWeight:
    """A [out_features, in_features] weight in storage format (see the module doc)."""

    data: torch.Tensor  # [out_features, row_bytes] uint8, contiguous, CPU
    qtype: QType
    in_features: int
    scales: torch.Tensor | None = None  # [out_features] fp32, INT8 only

    def __post_init__(self) -> None:
        block_values, block_bytes = BLOCK_SIZES[self.qtype]
        if self.in_features % block_values:
            raise ValueError(
                f"in_features {self.in_features} is not a multiple of the {self.qtype.name} "
                f"block size {block_values}."
            )
        expected = self.in_features // block_values * block_bytes
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"quantized data must be 2-D uint8, got {self.data.dtype}.")
        if self.data.shape[1] != expected or not self.data.is_contiguous():
            raise ValueError(
                f"{self.qtype.name} rows of {self.in_features} values take {expected} bytes, "
                f"got data of shape {tuple(self.data.shape)} (contiguous: "
                f"{self.data.is_contiguous()})."
            )
        if (self.scales is None) != (self.qtype != QType.INT8):
            raise ValueError("scales are given for (and only for) INT8 weights.")

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        extra = 0 if self.scales is None else self.scales.numel() * 4
        return self.data.numel() + extra

    def take_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight with output rows `index` (a permutation or a selection)."""
        scales = None if self.scales is None else self.scales[index].contiguous()
        return QuantizedWeight(self.data[index].contiguous(), self.qtype, self.in_features, scales)

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows [start, end) as fp32: [end - start, in_features]."""
        end = self.out_features if end is None else end
        if not 0 <= start <= end <= self.out_features:
            raise ValueError(f"rows [{start}, {end}) outside [0, {self.out_features}).")
        out = torch.empty(end - start, self.in_features, dtype=torch.float32)
        _lib().quant_dequantize_f32(
            out.data_ptr(),
            self.data.data_ptr(),
            self.data.shape[1],
            None if self.scales is None else self.scales.data_ptr(),
            int(self.qtype),
            start,
            end,
            self.in_features,
            torch.get_num_threads(),
        )
        return out


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stacks weights of one type along the output dimension (a fused q|k|v projection)."""
    qtypes = {part.qtype for part in parts}
    in_features = {part.in_features for part in parts}
    if len(qtypes) != 1 or len(in_features) != 1:
        raise ValueError(f"cannot fuse weights of types {qtypes} and in_features {in_features}.")
    scales = None
    if parts[0].scales is not None:
        scales = torch.cat([p.scales for p in parts if p.scales is not None])
    data = torch.cat([part.data for part in parts])
    return QuantizedWeight(data, parts[0].qtype, parts[0].in_features, scales)


def fp32_weight(weight: torch.Tensor) -> QuantizedWeight:
    """An fp32 [out_features, in_features] weight as an F32 `QuantizedWeight` sharing its
    memory (no copy): the native GEMV on unquantized layers."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"weight must be 2-D fp32 on CPU, got {weight.dtype} {weight.dim()}-D.")
    data = weight.detach().contiguous().view(torch.uint8)  # [out_features, 4 * in_features]
    return QuantizedWeight(data, QType.F32, weight.shape[1])


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Per-output-channel symmetric int8: scale = max|w_row| / 127, q = round(w / scale)."""
    weight = weight.detach().float()
    scales = weight.abs().amax(dim=1) / 127.0  # [out_features]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(q.view(torch.uint8).contiguous(), QType.INT8, weight.shape[1], scales)


def quant_linear(
    x: torch.Tensor,  # [..., in_features] fp32
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [..., out_features] fp32
    """x @ W.T (+ bias) with W kept quantized (see the module doc)."""
    # A decode step calls this ~100 times with small inputs: the checks and the reshapes
    # below are kept to the ones needed (each torch call costs about a microsecond).
    if x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(f"quant_linear takes fp32 CPU activations, got {x.dtype} on {x.device}.")
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"activation width {x.shape[-1]} != in_features {weight.in_features}.")
    x2 = x if x.dim() == 2 else x.reshape(-1, weight.in_features)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, weight.out_features, dtype=torch.float32)
    if rows:
        kernel = "quant_gemm_f32" if rows > GEMV_MAX_ROWS else "quant_linear_f32"
        status = getattr(_lib(), kernel)(
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
            raise MemoryError(f"{kernel} could not allocate its buffers.")
    if bias is not None:
        out += bias
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weight.out_features)


def available_isas() -> list[Isa]:
    """The kernel paths this CPU (and this build) can run, narrowest first."""
    return [isa for isa in Isa if _lib().quant_isa_supported(int(isa))]


def active_isa() -> Isa:
    return Isa(_lib().quant_active_isa())


def set_isa(isa: Isa | None) -> None:
    """Forces a kernel path (None: the widest available again); ValueError if unsupported."""
    if _lib().quant_set_isa(-1 if isa is None else int(isa)) != 0:
        raise ValueError(f"this CPU cannot run the {Isa(isa).name} quantized kernels.")


_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    # out, out_stride, x, x_stride, rows, w, row_bytes, scales, type, n_out, k, threads
    "quant_linear_f32": (
        [_ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, _int, _i64, _i64, _int],
        _int,
    ),
    # the same arguments: the GEMM for more rows than GEMV_MAX_ROWS
    "quant_gemm_f32": (
        [_ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, _int, _i64, _i64, _int],
        _int,
    ),
    # out, w, row_bytes, scales, type, n0, n1, k, threads
    "quant_dequantize_f32": ([_ptr, _ptr, _i64, _ptr, _int, _i64, _i64, _i64, _int], None),
    "quant_isa_supported": ([_int], _int),
    "quant_active_isa": ([], _int),
    "quant_set_isa": ([_int], _int),
}


@functools.cache
def _lib() -> ctypes.CDLL:
    """The native library with the quantized kernels' signatures set; applies
    $PAGEDSERVE_QUANT_ISA once. Raises NativeKernelError where it cannot be built."""
    library = load_library()
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = restype
    forced = os.environ.get(QUANT_ISA_ENV, "").strip().lower()
    if forced and forced != "auto":
        if forced.upper() not in Isa.__members__:
            raise ValueError(f"${QUANT_ISA_ENV} must be auto, portable, avx2 or avx512: {forced!r}")
        if library.quant_set_isa(int(Isa[forced.upper()])) != 0:
            raise ValueError(f"${QUANT_ISA_ENV}={forced}: this CPU cannot run that path.")
    return library
