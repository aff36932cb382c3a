"""SiLU-and-mul vs. the torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels import ref_silu_and_mul, silu_and_mul
from tests.kernels._helpers import DTYPES, TOLERANCES, device, pick


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [64, 1000, pick(1536, 14336)])
def test_matches_reference(dtype: torch.dtype, intermediate: int) -> None:
    num_tokens = pick(5, 2051)
    gen = torch.Generator().manual_seed(intermediate)
    x = (3 * torch.randn(num_tokens, 2 * intermediate, generator=gen)).to(dtype).to(device())
    out = silu_and_mul(x)
    assert out.shape == (num_tokens, intermediate)
    torch.testing.assert_close(out, ref_silu_and_mul(x), **TOLERANCES[dtype])


def test_known_values() -> None:
    """silu(0) * 5 = 0; silu(2) * 1 = 2 * sigmoid(2)."""
    x = torch.tensor([[0.0, 2.0, 5.0, 1.0]], device=device())
    expected = torch.tensor([[0.0, 2.0 * torch.sigmoid(torch.tensor(2.0)).item()]])
    torch.testing.assert_close(silu_and_mul(x).cpu(), expected, atol=1e-6, rtol=1e-6)
