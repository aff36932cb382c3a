"""Per-token-group FP8 quantization (kernels/fp8_group_quant.py) against torch: each group's
scale within one fp32 ulp of its amax / 448 (bit for bit on the CPU; torch on CUDA divides
by a scalar as a multiply by its reciprocal), the FP8 values the same bits as torch's cast
of x / scale; groups of 128 and the tests' odd widths, a ragged last group, rows of very
different magnitudes, an outlier that must not coarsen its row's other groups, zero rows;
the column-major scale layout the GEMM reads; bad operands refused by name."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_group_quant import (
    FP8_DTYPE,
    dequantize_groups_float64,
    quantize_per_token_group_fp8,
    ref_quantize_per_token_group_fp8,
)
from tests.kernels._helpers import DTYPES, device, pick
from tests.triton_utils import import_triton

import_triton()


def _x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-4, 3, m)[:, None]  # rows of very different scales
    x = (torch.randn(m, k, generator=gen) * magnitudes).to(dtype)
    x[min(1, m - 1)] = 0.0  # a zero row
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "group"), [(256, 128), (200, 128), (200, 64), (144, 48), (96, 32)])
def test_same_bits_as_torch(dtype: torch.dtype, k: int, group: int) -> None:
    m = pick(7, 300)
    x = _x(m, k, dtype, seed=k + group).to(device())
    q, scale = quantize_per_token_group_fp8(x, group)
    q_ref, scale_ref = ref_quantize_per_token_group_fp8(x, group)
    groups = -(-k // group)
    assert q.dtype == FP8_DTYPE and q.shape == (m, k)
    assert scale.shape == (m, groups) and scale.stride() == (1, m)  # column-major
    exact = 0.0 if x.device.type == "cpu" else 2.0**-23
    torch.testing.assert_close(scale, scale_ref, rtol=exact, atol=0)
    spread = scale.repeat_interleave(group, 1)[:, :k]
    q_torch = (x.float() / spread).clamp(-448.0, 448.0).to(FP8_DTYPE)  # torch's cast, same scale
    assert torch.equal(q.view(torch.uint8), q_torch.view(torch.uint8))
    if x.device.type == "cpu":
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_an_outlier_scales_its_own_group_only() -> None:
    """One 1000 among values of about 1: its group's scale is 1000 / 448, the other groups'
    stay at their own amax / 448, and every value dequantizes within E4M3's half step."""
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(0))
    x[1, 70] = 1000.0
    q, scale = quantize_per_token_group_fp8(x.to(device()), 64)
    scale = scale.cpu()
    expected = x.view(3, 3, 64).abs().amax(-1) / 448.0
    torch.testing.assert_close(scale, expected, rtol=2.0**-23, atol=0)
    assert scale[1, 1] == pytest.approx(1000.0 / 448.0) and scale[1, 0] < 0.02
    error = (dequantize_groups_float64(q.cpu(), scale, 64) - x.double()).abs()
    spread = scale.double().repeat_interleave(64, 1)
    assert bool((error <= x.double().abs() * 2.0**-4 + spread * 2.0**-10).all())


def test_a_strided_row_view() -> None:
    """Rows need only a contiguous last dimension (a slice of a wider buffer)."""
    wide = _x(5, 320, torch.float32, seed=3).to(device())
    x = wide[:, :256]
    q, scale = quantize_per_token_group_fp8(x, 128)
    q_ref, scale_ref = quantize_per_token_group_fp8(x.contiguous(), 128)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale, scale_ref)


def test_empty_and_bad_operands() -> None:
    q, scale = quantize_per_token_group_fp8(torch.empty(0, 64, device=device()), 32)
    assert q.shape == (0, 64) and scale.shape == (0, 2)
    x = torch.randn(2, 64, device=device())
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        quantize_per_token_group_fp8(x, 0)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        quantize_per_token_group_fp8(x, True)
    with pytest.raises(ValueError, match="x must have dtype"):
        quantize_per_token_group_fp8(x.double(), 32)
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        quantize_per_token_group_fp8(x[None], 32)
    with pytest.raises(ValueError, match="x must be contiguous in its last dimension"):
        quantize_per_token_group_fp8(x.T, 32)
