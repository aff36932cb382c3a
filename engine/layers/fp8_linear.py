"""FP8 (E4M3) projections computed on FP8 tensor cores: `Fp8LinearMethod`.

A projection of an FP8 checkpoint (engine/config/weights/fp8_checkpoint.py) keeps its weight in
float8_e4m3fn with one fp32 scale per output row; each call quantizes the activations per
token and runs one scaled GEMM::

    x [M, K] bf16 ──amax per row / 448──▶ s_x [M, 1] fp32
                  ──x / s_x, saturate──▶  q_x [M, K] fp8
    out [M, N] = (q_x @ W_q.T) * s_x * s_w[None, :]      W_q [N, K] fp8, s_w [N] fp32

`torch._scaled_mm` computes that product with row-wise scales (sm_89+: cuBLASLt's FP8
GEMM; torch also runs it on the CPU, which is how the tests force this path). It needs K and
N multiples of 16: a misaligned layer is zero-padded here (real models' dims are aligned,
so the pad is a test-shape case).

Why per-row weight scales even for per-tensor checkpoints: a fused q|k|v (or gate|up) layer
gets one scale per shard; spreading each shard's scale over its rows keeps every stored
FP8 value exact (vLLM instead requantizes the shards to their largest scale, which rounds
twice) and still needs only one row-wise `_scaled_mm`.

Why per-token dynamic activation scales even for static checkpoints: the calibrated
`input_scale` is an upper bound over a calibration set; a token's own amax is never
coarser, so the error can only shrink, at the cost of one row reduction per call.

Decode rows take another route on CUDA: up to `max_kernel_rows` rows, the Triton GEMV of
kernels/fp8_gemv.py (W8A16: the weight dequantized in registers, the activations not
quantized at all, so within the same error bound) instead of quantize + `_scaled_mm`, whose
FP8 GEMM at a few rows is far from the weights' bandwidth. The threshold is measured per
shape at load (engine/layers/crossover.py; `FP8_GEMV_MAX_ROWS` until then, or when the
measurement is off). On the CPU there is no GEMV: every row count takes `_scaled_mm`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# A row of zeros gets this scale instead of 0 (no division by zero; the row stays 0).
_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
_ALIGN = 16  # _scaled_mm: K and N multiples of 16
# "fp8" keeps FP8 checkpoints' weights in FP8 on any device (torch runs _scaled_mm on the
# CPU too, slowly: how the tests run this path), "dequantize" dequantizes them at load;
# unset or "auto": FP8 where the device has FP8 tensor cores.
FP8_COMPUTE_ENV = "PAGEDSERVE_FP8_COMPUTE"

# Rows up to which CUDA layers take the GEMV before the crossover is measured (or with the
# measurement off: $PAGEDSERVE_KERNEL_ROWS=off). Not measured: the GEMV's regime by design.
FP8_GEMV_MAX_ROWS = 16

ScaledMM = Callable[..., torch.Tensor]
Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Gemv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def quantize_per_token(
    x: torch.Tensor,  # [M, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # fp8 [M, K], fp32 [M, 1]
    """Symmetric per-row FP8 quantization: scale = amax / 448, values saturated."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_weight_per_row(
    weight: torch.Tensor,  # [N, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # fp8 [N, K], fp32 [N]
    """A float weight as FP8 with one scale per output row (random-weight benchmarks)."""
    q, scale = quantize_per_token(weight)
    return q, scale.reshape(-1)


def _pad_to(t: torch.Tensor, dim: int) -> torch.Tensor:
    size = t.shape[dim]
    pad = (-size) % _ALIGN
    if pad == 0:
        return t
    widths = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, pad]
    return F.pad(t.view(torch.uint8), widths).view(t.dtype)  # FP8 zeros are byte 0


def fp8_linear(
    x: torch.Tensor,  # [..., K] bf16 / fp16 / fp32
    weight: torch.Tensor,  # fp8 [N, K]
    weight_scale: torch.Tensor,  # fp32 [N]
    bias: torch.Tensor | None = None,  # [N]
    scaled_mm: ScaledMM = torch._scaled_mm,
    quantize: Quantizer | None = None,  # None: `quantize_per_token` (torch ops)
) -> torch.Tensor:  # [..., N] in x's dtype
    """x @ dequant(weight).T + bias with x quantized per token (see the module doc)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k).contiguous()
    q_x, s_x = (quantize or quantize_per_token)(x2)
    q_x = _pad_to(q_x, 1)  # [M, K'] : K' a multiple of 16
    w = _pad_to(_pad_to(weight, 1), 0)  # [N', K']
    s_w = weight_scale.float().reshape(1, n)
    if w.shape[0] != n:
        s_w = F.pad(s_w, (0, w.shape[0] - n), value=1.0)
    out_dtype = x.dtype if x.dtype != torch.float32 else torch.float32
    out = scaled_mm(q_x, w.t(), scale_a=s_x, scale_b=s_w, out_dtype=out_dtype)  # [M, N']
    out = out[:, :n]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


def scaled_mm_reference(
    a: torch.Tensor,  # fp8 [M, K]
    b: torch.Tensor,  # fp8 [K, N]
    *,
    scale_a: torch.Tensor,  # fp32 [M, 1]
    scale_b: torch.Tensor,  # fp32 [1, N]
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N]
    """`torch._scaled_mm` in float64: the exact product of the dequantized operands."""
    product = (a.double() @ b.double()) * scale_a.double() * scale_b.double()
    return product.to(out_dtype)


class Fp8LinearMethod:
    """The `LinearMethod` of an FP8 projection: reads the layer's `weight` (fp8 [N, K]) and
    `weight_scale` (fp32 [N]) at each call, so sleep/wake's swaps of `.data` are seen.
    With a `gemv` (CUDA: `fp8_gemv_kernel`), rows up to `max_kernel_rows` take it; it is a
    `TwoRoutes` method (engine/layers/crossover.py), which measures that threshold."""

    def __init__(
        self,
        layer: torch.nn.Module,
        scaled_mm: ScaledMM = torch._scaled_mm,
        quantize: Quantizer | None = None,
        gemv: Gemv | None = None,
        max_kernel_rows: int = FP8_GEMV_MAX_ROWS,
    ) -> None:
        self.layer = layer
        self.scaled_mm = scaled_mm
        self.quantize = quantize
        self.gemv = gemv
        self.max_kernel_rows = max_kernel_rows if gemv is not None else 0

    @property
    def in_features(self) -> int:
        return self.layer.weight.shape[1]

    def crossover_key(self) -> str | None:
        if self.gemv is None:
            return None
        n, k = self.layer.weight.shape
        per_tensor = " per-tensor" if self.layer.weight_scale.numel() == 1 else ""
        return f"fp8 {n}x{k}{per_tensor}"

    def route(self, x: torch.Tensor, kernel: bool) -> torch.Tensor:  # [M, K] -> [M, N]
        layer = self.layer
        if kernel:
            assert self.gemv is not None, "no GEMV on this device"
            return self.gemv(x, layer.weight, layer.weight_scale)
        return fp8_linear(x, layer.weight, layer.weight_scale, None, self.scaled_mm, self.quantize)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        layer = self.layer
        n, k = layer.weight.shape
        x2 = x.reshape(-1, k)
        if self.gemv is None or x2.shape[0] > self.max_kernel_rows:
            return fp8_linear(x, layer.weight, layer.weight_scale, bias, self.scaled_mm,
                              self.quantize)  # fmt: skip
        out = self.gemv(x2.contiguous(), layer.weight, layer.weight_scale)  # [M, N]
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], n)


def token_quantizer(triton: bool) -> Quantizer:
    """The per-token activation quantization, chosen once at build: the one-pass Triton
    kernel (kernels/fp8_quant.py: `quantize_per_token`'s values, 6-9x faster on an H200)
    for a CUDA model, the torch ops elsewhere (no Triton on the CPU image)."""
    if not triton:
        return quantize_per_token
    from kernels.fp8_quant import quantize_per_token_fp8

    return quantize_per_token_fp8


def fp8_gemv_kernel(triton: bool) -> Gemv | None:
    """The decode-row GEMV, chosen once at build: kernels/fp8_gemv.py for a CUDA model,
    None elsewhere (the CPU keeps `_scaled_mm` at every row count)."""
    if not triton:
        return None
    from kernels.fp8_gemv import fp8_gemv

    return fp8_gemv


def fp8_compute_forced() -> bool | None:
    """$PAGEDSERVE_FP8_COMPUTE: True ("fp8"), False ("dequantize"), None ("auto"/unset)."""
    value = os.environ.get(FP8_COMPUTE_ENV, "").strip().lower() or "auto"
    choices = {"auto": None, "fp8": True, "dequantize": False}
    if value not in choices:
        raise ValueError(f"${FP8_COMPUTE_ENV} must be auto, fp8 or dequantize: {value!r}")
    return choices[value]


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether `device` multiplies FP8 in hardware (CUDA sm_89+: Ada, Hopper, Blackwell)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)
