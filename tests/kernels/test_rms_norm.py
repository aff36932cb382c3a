"""RMSNorm (with and without the fused residual add) vs. the torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels import ref_rms_norm, rms_norm
from tests.kernels._helpers import DTYPES, TOLERANCES, device, pick


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_reference(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    num_tokens = pick(7, 4099)
    gen = torch.Generator().manual_seed(hidden)
    # x as a strided view (a wider buffer's first columns) to exercise the row stride.
    wide = torch.randn(num_tokens, hidden + 16, generator=gen).to(dtype).to(device())
    x = wide[:, :hidden]
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device())
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(device())
    eps = 1e-5
    tol = TOLERANCES[dtype]
    if with_residual:
        x_before, residual_before = x.clone(), residual.clone()
        out, new_residual = rms_norm(x, weight, eps, residual)
        expected_out, expected_residual = ref_rms_norm(x, weight, eps, residual)
        torch.testing.assert_close(new_residual, expected_residual, **tol)
        torch.testing.assert_close(out, expected_out, **tol)
        # Inputs are left alone.
        torch.testing.assert_close(x, x_before, atol=0, rtol=0)
        torch.testing.assert_close(residual, residual_before, atol=0, rtol=0)
    else:
        out = rms_norm(x, weight, eps)
        torch.testing.assert_close(out, ref_rms_norm(x, weight, eps), **tol)


def test_known_values() -> None:
    """A row [3, 4] has RMS sqrt(12.5); with weight [1, 2] the output is [3, 8] / sqrt(12.5)."""
    x = torch.tensor([[3.0, 4.0]], device=device())
    weight = torch.tensor([1.0, 2.0], device=device())
    out = rms_norm(x, weight, 0.0)
    expected = torch.tensor([[3.0, 8.0]], device=device()) / 12.5**0.5
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
