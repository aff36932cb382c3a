"""The batch-invariant matmul (kernels/batch_invariant_matmul.py): a row's bits alone equal
the same row's bits at any place in batches of 1..70 rows, and the product is close to a
float64 reference. In the interpreter on the CPU, natively on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.batch_invariant_matmul import (
    invariant_matmul,
    invariant_matmul_config,
    ref_invariant_matmul,
)

from ._helpers import DTYPES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("n", "k", "with_bias"), [(24, 40, False), (72, 96, True)])
def test_a_row_has_the_same_bits_in_any_batch(n: int, k: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(DEVICE) if with_bias else None
    probe = torch.randn(1, k, generator=gen).to(DEVICE)
    alone = invariant_matmul(probe, weight, bias)
    for m in (2, 7, 16, 17, 33, 40, 70):
        batch = torch.randn(m, k, generator=gen).to(DEVICE)
        for place in {0, m // 2, m - 1}:
            batch[place] = probe[0]
            got = invariant_matmul(batch, weight, bias)
            assert torch.equal(got[place], alone[0]), (m, place)
            batch = torch.randn(m, k, generator=gen).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_close_to_the_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(19, 80, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(50, 80, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(50, generator=gen).to(DEVICE, dtype)
    got = invariant_matmul(x, weight, bias)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.5, rtol=2e-2)
    torch.testing.assert_close(got, ref_invariant_matmul(x, weight, bias), **tol)
    want = torch.matmul(x.float(), weight.float().T) + bias.float()
    torch.testing.assert_close(got.float(), want, **tol)


def test_the_configuration_depends_on_n_k_and_dtype_only() -> None:
    # the launcher takes M from nothing but the grid: the same (N, K, dtype), one config
    assert invariant_matmul_config(4096, 4096, torch.bfloat16) == invariant_matmul_config(
        4096, 4096, torch.bfloat16
    )
    assert invariant_matmul_config(24, 40, torch.float32)["BLOCK_N"] == 32
    assert invariant_matmul_config(24, 40, torch.float32)["BLOCK_K"] == 64
    assert invariant_matmul_config(128256, 4096, torch.bfloat16)["BLOCK_N"] == 64
    assert invariant_matmul_config(4096, 14336, torch.bfloat16)["BLOCK_N"] == 32


def test_bad_inputs_are_refused() -> None:
    x = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        invariant_matmul(x, torch.zeros(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        invariant_matmul(x, torch.zeros(4, 8, device=DEVICE, dtype=torch.float16))
    assert invariant_matmul(x[:0], torch.zeros(4, 8, device=DEVICE)).shape == (0, 4)
