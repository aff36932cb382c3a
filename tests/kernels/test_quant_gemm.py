"""The dequantize-GEMM (engine/native/quant_gemm.c, `quant_linear` above GEMV_MAX_ROWS rows)
against gguf-py's dequantize followed by an fp64 matmul: every block type, int8 and fp32
rows, over row counts, output counts and widths that leave tails at every level of its
tiling (16-row tiles, 16-output panels, 256-value k-blocks, row chunks), with each ISA
path this CPU runs forced in turn and compared with the others."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.native import native_kernels_available

pytestmark = pytest.mark.skipif(
    not native_kernels_available(), reason="no C compiler: native kernels unavailable"
)

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as GT  # noqa: E402

from engine.native.quant import (  # noqa: E402
    BLOCK_SIZES,
    GEMV_MAX_ROWS,
    QType,
    QuantizedWeight,
    available_isas,
    fp32_weight,
    quant_linear,
    quantize_int8,
    set_isa,
)
from tests.engine.gguf_files import random_blocks  # noqa: E402

EPS = torch.finfo(torch.float32).eps


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    set_isa(None)


def _weight(qtype: QType, out_features: int, cols: int, seed: int):
    """(the weight, the fp32 matrix it stands for)"""
    if qtype in (QType.F32, QType.INT8):
        w = torch.randn(out_features, cols, generator=torch.Generator().manual_seed(seed))
        if qtype == QType.F32:
            return fp32_weight(w), w
        weight = quantize_int8(w)
        return weight, weight.dequantize()
    blocks = random_blocks(qtype, out_features, cols, seed=seed)
    dense = gguf.quants.dequantize(blocks, GT(int(qtype))).astype(np.float32)
    return QuantizedWeight(torch.from_numpy(blocks), qtype, cols), torch.from_numpy(dense)


def _check_all_isas(x: torch.Tensor, weight: QuantizedWeight, dense: torch.Tensor, bias):
    """Each ISA path within a few fp32 epsilons of the summed magnitudes from the exact
    result, and the paths within twice that of each other (a wrong block decode, a lost
    tile or a misplaced panel is off by far more)."""
    expected = x.double() @ dense.double().T
    magnitude = x.double().abs() @ dense.double().abs().T
    if bias is not None:
        expected += bias.double()
        magnitude += bias.double().abs()
    bound = 8 * EPS * magnitude + 1e-30
    results = {}
    for isa in available_isas():
        set_isa(isa)
        results[isa] = quant_linear(x, weight, bias).double()
        error = ((results[isa] - expected).abs() / bound).max().item()
        assert error <= 1.0, (isa.name, error)
    first_isa, first = next(iter(results.items()))
    for isa, other in results.items():
        assert ((other - first).abs() <= 2 * bound).all(), (isa.name, first_isa.name)


# (rows, out_features, blocks per row): rows past the 16-row tiles and the row chunks
# (448 rows at 576 values, 160 at 1536, 32 at 8192); outputs past the 16-output panels;
# from 256 rows per thread, slices of rows per thread (1100 rows: several per thread).
GRID_32 = [(17, 40, 1), (33, 200, 3), (71, 12, 18), (300, 3088, 18), (GEMV_MAX_ROWS + 1, 5, 256)]
GRID_256 = [(17, 40, 1), (33, 200, 3), (71, 13, 2), (300, 590, 6), (50, 20, 32), (1100, 40, 8)]


_BLOCK_CASES = [
    pytest.param(qtype, *case, id=f"{qtype.name}-{'-'.join(map(str, case))}")
    for qtypes, grid in (
        ((QType.Q8_0, QType.Q4_0, QType.Q4_1), GRID_32),
        ((QType.Q4_K, QType.Q6_K), GRID_256),
    )
    for qtype in qtypes
    for case in grid
]


@pytest.mark.parametrize(("qtype", "rows", "out_features", "blocks_per_row"), _BLOCK_CASES)
def test_gemm_block_types(qtype, rows, out_features, blocks_per_row):
    cols = blocks_per_row * BLOCK_SIZES[qtype][0]
    weight, dense = _weight(qtype, out_features, cols, seed=rows + out_features)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=generator)
    bias = torch.randn(out_features, generator=generator) if rows % 2 else None
    _check_all_isas(x, weight, dense, bias)


@pytest.mark.parametrize("qtype", [QType.F32, QType.INT8], ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("rows", "out_features", "cols"),
    [
        (17, 40, 1),
        (33, 200, 45),
        (71, 13, 577),
        (300, 3088, 576),
        (200, 30, 1536),
        (1100, 40, 2040),
    ],
)
def test_gemm_fp32_and_int8_rows(qtype, rows, out_features, cols):
    """Any width (no blocks): k tails inside the 16-value transpose and the 256-value
    k-blocks."""
    weight, dense = _weight(qtype, out_features, cols, seed=cols)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    _check_all_isas(x, weight, dense, bias)


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_gemm_thread_counts_split_rows_and_panels(threads):
    """600 rows: slices of rows per thread at 1 and 2 threads, panels (and groups of row
    tiles, as there are few panels) at 3 and 8; any count gives the same numbers (every
    output is one thread's sum in one order)."""
    weight, dense = _weight(QType.Q4_1, 30, 64, seed=3)
    x = torch.randn(600, 64, generator=torch.Generator().manual_seed(0))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = quant_linear(x, weight)
        torch.set_num_threads(threads)
        many = quant_linear(x, weight)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(many, single, rtol=0, atol=0)
    torch.testing.assert_close(many, x @ dense.T, rtol=1e-4, atol=1e-4)


def test_gemm_strided_activations_and_leading_dims():
    weight, dense = _weight(QType.Q8_0, 50, 64, seed=5)
    wide = torch.randn(40, 100, generator=torch.Generator().manual_seed(1))[:, 20:84]
    torch.testing.assert_close(quant_linear(wide, weight), wide @ dense.T, rtol=1e-4, atol=1e-4)
    batched = torch.randn(3, 11, 64, generator=torch.Generator().manual_seed(2))  # 33 rows
    torch.testing.assert_close(
        quant_linear(batched, weight), batched @ dense.T, rtol=1e-4, atol=1e-4
    )
