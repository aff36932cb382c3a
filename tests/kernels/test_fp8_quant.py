"""Per-token FP8 quantization (kernels/fp8_quant.py) against torch: the scale within one
fp32 ulp of amax / 448 (torch on CUDA divides by a scalar as a multiply by its reciprocal,
the kernel divides exactly; on the CPU they agree bit for bit), and the FP8 values the same
bits as torch's own cast of x / scale, across dtypes, row widths (one block, several, a
ragged tail), magnitudes from subnormal to large, values on rounding ties and zero rows."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_quant import (
    FP8_DTYPE,
    quantize_per_token_fp8,
    ref_quantize_per_token_fp8,
)
from tests.kernels._helpers import DTYPES, device, pick


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [16, 1000, 2500])
def test_same_bits_as_torch(dtype: torch.dtype, k: int) -> None:
    num_tokens = pick(6, 513)
    gen = torch.Generator().manual_seed(k)
    magnitudes = torch.logspace(-4, 3, num_tokens)[:, None]  # rows of very different scales
    x = (torch.randn(num_tokens, k, generator=gen) * magnitudes).to(dtype)
    x[1] = 0.0  # a zero row
    x[2, :8] = torch.tensor([1e-6, -1e-6, 3e-5, 0.0, 1.0, -1.0, 0.5, 7.0])  # tiny beside big
    x = x.to(device())
    q, scale = quantize_per_token_fp8(x)
    _, scale_ref = ref_quantize_per_token_fp8(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (num_tokens, 1)
    exact = 0.0 if x.device.type == "cpu" else 2.0**-23
    torch.testing.assert_close(scale, scale_ref, rtol=exact, atol=0)
    q_ref = (x.float() / scale).clamp(-448.0, 448.0).to(FP8_DTYPE)  # torch's cast, same scale
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_ties_round_to_even_and_binade_carries() -> None:
    """Values halfway between E4M3 neighbours, and just below a power of two (where the
    interpreter's own FP8 cast fails), in a row scaled by exactly 1 (its amax is 448)."""
    row = torch.tensor([448.0, 8.5, 9.5, 17.0, 19.0, 125.1, 31.9, 0.01171875, -(2.0**-10), 0.0])
    q, scale = quantize_per_token_fp8(row[None].to(device()))
    q_ref, _ = ref_quantize_per_token_fp8(row[None])
    assert scale.item() == 1.0
    assert q.cpu().float().tolist() == q_ref.float().tolist()
    assert q.cpu().float()[0, 1:7].tolist() == [8.0, 10.0, 16.0, 20.0, 128.0, 32.0]


def test_an_empty_batch() -> None:
    q, scale = quantize_per_token_fp8(torch.empty(0, 64, device=device()))
    assert q.shape == (0, 64) and scale.shape == (0, 1)
