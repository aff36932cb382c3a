"""The INT4 dequantize-GEMM and dequantize kernels (AWQ / GPTQ weights) against the torch
reference, over row counts around the tile height, group sizes (per channel too) and
widths that leave partial tiles; in the interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.int4_gemm import int4_dequantize, int4_gemm
from kernels.reference import ref_int4_dequantize, ref_int4_gemm
from tests.kernels._helpers import DTYPES, device, pick
from tests.triton_utils import import_triton

import_triton()


def _weight(k: int, n: int, group_size: int, dtype: torch.dtype, seed: int = 0):
    """Random codes packed along the input, scales, and integer zero points."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int64)
    shifts = 4 * torch.arange(8, dtype=torch.int64)[None, :, None]
    words = (codes.reshape(k // 8, 8, n) << shifts).sum(dim=1)  # unsigned 32-bit values
    qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    groups = k // group_size
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, 16, (groups, n), generator=gen).to(dtype)
    return codes, qweight.to(device()), scales.to(device()), zeros.to(device())


def test_reference_decodes_the_layout() -> None:
    """The reference gives (code - zero) * scale for codes written nibble by nibble."""
    codes, qweight, scales, zeros = _weight(64, 24, 32, torch.float32, seed=3)
    groups = torch.arange(64) // 32
    expected = (codes.float() - zeros.cpu()[groups]) * scales.cpu()[groups]
    torch.testing.assert_close(ref_int4_dequantize(qweight, scales, zeros, 32).cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 16, 17])
@pytest.mark.parametrize(
    ("k", "n", "group_size"),
    [(64, 72, 32), (256, 64, 128), (128, 40, 128), pytest.param(96, 64, 96, id="per-channel")],
)
def test_gemm_matches_reference(dtype, rows, k, n, group_size) -> None:
    rows = pick(rows, rows * 7)
    _, qweight, scales, zeros = _weight(k, n, group_size, dtype, seed=rows + k)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(device())
    out = int4_gemm(x, qweight, scales, zeros, group_size)
    assert out.shape == (rows, n) and out.dtype == dtype
    expected = ref_int4_gemm(x, qweight, scales, zeros, group_size)
    # x and the dequantized tile are rounded to `dtype` before the fp32-accumulated dot.
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_matches_reference(dtype) -> None:
    _, qweight, scales, zeros = _weight(128, 72, 32, dtype, seed=7)
    out = int4_dequantize(qweight, scales, zeros, 32, dtype)
    expected = ref_int4_dequantize(qweight, scales, zeros, 32)
    assert out.shape == (128, 72) and out.dtype == dtype
    torch.testing.assert_close(out, expected.to(dtype), atol=0, rtol=0)


def test_launcher_names_a_bad_argument() -> None:
    _, qweight, scales, zeros = _weight(64, 16, 32, torch.float32)
    x = torch.randn(2, 64, device=device())
    with pytest.raises(ValueError, match="qweight must have dtype"):
        int4_gemm(x, qweight.float(), scales, zeros, 32)
    with pytest.raises(ValueError, match=r"scales must be \[2, 16\]"):
        int4_gemm(x, qweight, scales[:1].contiguous(), zeros, 32)
    with pytest.raises(ValueError, match="x has 32 columns"):
        int4_gemm(x[:, :32].contiguous(), qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match="group_size must divide"):
        int4_gemm(x, qweight, scales, zeros, 24)
