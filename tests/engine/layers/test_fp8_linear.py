"""FP8 projections (engine/layers/fp8_linear.py): per-token quantization and the scaled
GEMM against a float64 reference, within FP8's rounding bound; torch._scaled_mm (which torch
also runs on the CPU) against its float64 definition; misaligned shapes padded."""

from __future__ import annotations

import pytest
import torch

from engine.layers.fp8_linear import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8LinearMethod,
    fp8_compute_forced,
    fp8_gemv_kernel,
    fp8_linear,
    quantize_per_token,
    quantize_weight_per_row,
    scaled_mm_reference,
    token_quantizer,
)
from tests.triton_utils import import_triton

# E4M3: 3 mantissa bits, so rounding to nearest is off by at most 2^-4 of the value
# (normal numbers); below 2^-6 (subnormals) by at most half the spacing 2^-9, times the scale.
FP8_REL = 2.0**-4
FP8_SUBNORMAL_ABS = 2.0**-10


def _bound(x: torch.Tensor, scale: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|x_q @ W.T - x @ W.T| <= sum_k (|x|/16 + 2^-10 s_x) |W| elementwise (x_q: x rounded
    to FP8 with scale s_x)."""
    per_element = x.abs().double() * FP8_REL + FP8_SUBNORMAL_ABS * scale.double()
    return per_element @ w.abs().double().T


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_quantize_per_token_round_trip(rows) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator) * torch.logspace(-3, 2, rows)[:, None]
    x[0, :5] = 0.0
    q, scale = quantize_per_token(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (rows, 1)
    # each row's largest value maps to +-448 exactly
    torch.testing.assert_close(q.float().abs().amax(dim=1), torch.full((rows,), FP8_MAX))
    error = (q.double() * scale.double() - x.double()).abs()
    limit = x.abs().double() * FP8_REL + FP8_SUBNORMAL_ABS * scale.double()
    assert bool((error <= limit).all())


def test_a_zero_row_stays_zero() -> None:
    q, scale = quantize_per_token(torch.zeros(2, 32))
    assert bool((q.float() == 0).all()) and bool((scale > 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"), [(1, 48, 64), (5, 96, 32), (33, 64, 128)]
)
def test_fp8_linear_within_fp8_bound_of_float64(dtype, rows, out_features, in_features) -> None:
    generator = torch.Generator().manual_seed(rows * out_features)
    w_q, w_scale = quantize_weight_per_row(
        torch.randn(out_features, in_features, generator=generator)
    )
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    out = fp8_linear(x, w_q, w_scale, bias)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    w = w_q.double() * w_scale.double()[:, None]  # the stored weight, exactly
    expected = x.double() @ w.T + bias.double()
    _, x_scale = quantize_per_token(x)
    output_rounding = expected.abs() * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-20)
    limit = _bound(x, x_scale, w) + output_rounding + 1e-6
    assert bool(((out.double() - expected).abs() <= limit).all())
    # and the bound is not vacuous: the error is a real FP8 error, not zero
    assert (out.double() - expected).abs().max() > 0


def test_scaled_mm_matches_its_float64_definition() -> None:
    generator = torch.Generator().manual_seed(0)
    a, s_a = quantize_per_token(torch.randn(7, 64, generator=generator))
    b, s_b = quantize_weight_per_row(torch.randn(32, 64, generator=generator))
    got = torch._scaled_mm(a, b.t(), scale_a=s_a, scale_b=s_b[None, :], out_dtype=torch.float32)
    want = scaled_mm_reference(a, b.t(), scale_a=s_a, scale_b=s_b[None, :], out_dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _cuda_checked_scaled_mm(a, b, **kwargs):
    """scaled_mm_reference behind the operand checks CUDA's _scaled_mm makes (the CPU's
    does not): K and N multiples of 16, `b` column-major, row-wise fp32 scales."""
    assert a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0, (a.shape, b.shape)
    assert b.stride(0) == 1, "mat2 must be column-major"
    assert kwargs["scale_a"].shape == (a.shape[0], 1) and kwargs["scale_b"].shape == (1, b.shape[1])
    return scaled_mm_reference(a, b, **kwargs)


def test_misaligned_shapes_are_padded_for_scaled_mm() -> None:
    """K and N not multiples of 16: the operands reach the GEMM padded, and the result is
    the float64 definition's on the real rows and columns."""
    generator = torch.Generator().manual_seed(1)
    w_q, w_scale = quantize_weight_per_row(torch.randn(20, 40, generator=generator))
    x = torch.randn(3, 40, generator=generator)
    layer = torch.nn.Module()
    layer.weight, layer.weight_scale = w_q, w_scale
    out = Fp8LinearMethod(layer, _cuda_checked_scaled_mm).apply(x[None], None)  # [1, 3, 20]
    q_x, s_x = quantize_per_token(x)
    want = scaled_mm_reference(
        q_x, w_q.t(), scale_a=s_x, scale_b=w_scale[None, :], out_dtype=torch.float64
    )
    assert out.shape == (1, 3, 20)
    torch.testing.assert_close(out[0].double(), want, rtol=1e-6, atol=1e-6)


def test_forced_choice_from_the_environment(monkeypatch) -> None:
    for value, expected in (("", None), ("auto", None), ("fp8", True), ("dequantize", False)):
        monkeypatch.setenv("PAGEDSERVE_FP8_COMPUTE", value)
        assert fp8_compute_forced() is expected
    monkeypatch.setenv("PAGEDSERVE_FP8_COMPUTE", "int8")
    with pytest.raises(ValueError, match="PAGEDSERVE_FP8_COMPUTE"):
        fp8_compute_forced()


def test_the_cuda_quantizer_gives_the_same_layer_output() -> None:
    """The quantizer a CUDA model gets (the Triton kernel; here in the interpreter) and the
    torch ops give bit-identical FP8 activations, so the same layer output."""
    generator = torch.Generator().manual_seed(2)
    w_q, w_scale = quantize_weight_per_row(torch.randn(48, 80, generator=generator))
    x = torch.randn(2, 5, 80, generator=generator) * 3
    layer = torch.nn.Module()
    layer.weight, layer.weight_scale = w_q, w_scale
    triton_side = Fp8LinearMethod(layer, quantize=token_quantizer(triton=True)).apply(x, None)
    torch_side = Fp8LinearMethod(layer, quantize=token_quantizer(triton=False)).apply(x, None)
    assert torch.equal(triton_side, torch_side)


def test_the_cuda_layer_takes_the_gemv_up_to_its_threshold() -> None:
    """The layer a CUDA model gets (the GEMV in the interpreter here): rows up to
    `max_kernel_rows` give the GEMV's result (W8A16: within the FP8 bound of float64, and
    tighter), more rows the quantized `_scaled_mm` path's, bit for bit; bias and a leading
    batch dimension on both routes."""
    import_triton()
    from kernels.fp8_gemv import fp8_gemv

    generator = torch.Generator().manual_seed(5)
    w_q, w_scale = quantize_weight_per_row(torch.randn(40, 72, generator=generator))
    layer = torch.nn.Module()
    layer.weight, layer.weight_scale = w_q, w_scale
    method = Fp8LinearMethod(layer, gemv=fp8_gemv_kernel(triton=True), max_kernel_rows=3)
    assert method.crossover_key() == "fp8 40x72"
    bias = torch.randn(40, generator=generator)
    w = w_q.double() * w_scale.double()[:, None]
    for rows in (1, 3, 4):
        x = torch.randn(1, rows, 72, generator=generator)
        out = method.apply(x, bias)
        assert out.shape == (1, rows, 40)
        if rows <= 3:
            assert torch.equal(out[0], fp8_gemv(x[0], w_q, w_scale) + bias)
            expected = x[0].double() @ w.T + bias.double()
            _, x_scale = quantize_per_token(x[0])
            assert bool(((out[0].double() - expected).abs() <= _bound(x[0], x_scale, w)).all())
        else:
            assert torch.equal(out, fp8_linear(x, w_q, w_scale, bias))
