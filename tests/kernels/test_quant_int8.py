"""The int8 route of the quantized linear (engine/native/quant_int8.c) on every ISA path this
CPU runs (AVX-512 VNNI, AVX2 maddubs; each forced in turn): exactly its float64 reference
(the same per-block activation quants, integer dots, fp32 rounding only), and within the
activations' 8-bit rounding of gguf-py's dequantize followed by a float64 matmul."""

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

from engine.native.quant import Isa, QType, QuantizedWeight, available_isas, set_isa  # noqa: E402
from engine.native.quant_int8 import (  # noqa: E402
    INT8_QTYPES,
    Int8Isa,
    int8_applies,
    int8_isa,
    quant_linear_int8,
)
from tests.engine.gguf_files import random_blocks  # noqa: E402


def _int8_paths() -> list[Isa]:
    """The quantized paths (forced through `set_isa`) under which an int8 route runs."""
    paths = []
    for isa in available_isas():
        set_isa(isa)
        if int8_isa() != Int8Isa.NONE:
            paths.append(isa)
    set_isa(None)
    return paths


PATHS = _int8_paths() if native_kernels_available() else []
needs_route = pytest.mark.skipif(
    not PATHS, reason="this CPU has no int8 route (needs AVX2; VNNI for the AVX-512 path)"
)


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    set_isa(None)


def route_reference(x: torch.Tensor, qtype: QType, blocks: np.ndarray) -> torch.Tensor:
    """What the route computes, in float64 from the same int8 activation quants."""
    rows, k = x.shape
    xb = x.reshape(rows, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)  # fp32, as the kernel rounds it
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv).clamp(-127, 127).double()  # round half to even (nearbyintf)
    xd = (amax / 127.0).double()
    weight = torch.from_numpy(gguf.quants.dequantize(blocks, GT(int(qtype))).astype(np.float64))
    # The dequantized weight is exact in float64; xq * xd is the activation the route uses.
    return (xq * xd).reshape(rows, k) @ weight.T


def dequantized(qtype: QType, blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, GT(int(qtype))).astype(np.float64))


@needs_route
@pytest.mark.parametrize("qtype", INT8_QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 13])
@pytest.mark.parametrize(("out_features", "blocks_per_row"), [(1, 1), (17, 3), (40, 2)])
def test_route_matches_its_reference_and_the_dequantized_matmul(
    qtype, rows, out_features, blocks_per_row
):
    cols = 32 * blocks_per_row
    blocks = random_blocks(qtype, out_features, cols, seed=rows * 100 + out_features)
    weight = QuantizedWeight(torch.from_numpy(blocks), qtype, cols)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=generator)
    x[0, :32] *= 50.0  # blocks of very different scales in one row
    bias = torch.randn(out_features, generator=generator)
    w64 = dequantized(qtype, blocks)
    reference = route_reference(x, qtype, blocks) + bias.double()
    exact = x.double() @ w64.T + bias.double()
    # fp32 rounding of the route's sums: a few epsilons of the terms' magnitude.
    magnitude = x.double().abs() @ w64.abs().T + bias.double().abs()
    fp32_bound = 8 * torch.finfo(torch.float32).eps * magnitude
    # The activations' rounding: at most half a quant step (amax / 127 / 2) per value.
    step = x.reshape(rows, -1, 32).abs().amax(-1).double() / 127.0 / 2.0  # [rows, blocks]
    quant_bound = step.repeat_interleave(32, dim=1) @ w64.abs().T
    for isa in PATHS:
        set_isa(isa)
        assert int8_applies(weight)
        got = quant_linear_int8(x, weight, bias).double()
        assert ((got - reference).abs() <= fp32_bound).all(), (isa.name, int8_isa().name)
        assert ((got - exact).abs() <= quant_bound + fp32_bound).all(), isa.name


@needs_route
def test_paths_agree_and_a_large_shape_is_right():
    """Every panel (16 outputs) and row tile (8, 4, 2, 1 rows) of a larger call."""
    blocks = random_blocks(QType.Q4_1, 200, 576, seed=3)
    weight = QuantizedWeight(torch.from_numpy(blocks), QType.Q4_1, 576)
    x = torch.randn(45, 576, generator=torch.Generator().manual_seed(1))
    reference = route_reference(x, QType.Q4_1, blocks)
    magnitude = x.double().abs() @ dequantized(QType.Q4_1, blocks).abs().T
    for isa in PATHS:
        set_isa(isa)
        got = quant_linear_int8(x, weight).double()
        assert ((got - reference).abs() <= 8 * 2**-23 * magnitude).all(), isa.name


@needs_route
def test_non_finite_activations_give_nan_in_their_row_only():
    blocks = random_blocks(QType.Q8_0, 20, 64, seed=1)
    weight = QuantizedWeight(torch.from_numpy(blocks), QType.Q8_0, 64)
    x = torch.randn(5, 64)
    x[2, 40] = float("inf")
    for isa in PATHS:
        set_isa(isa)
        out = quant_linear_int8(x, weight)
        assert out[2].isnan().all()
        assert torch.isfinite(out[[0, 1, 3, 4]]).all()


def test_types_without_a_route_are_refused():
    blocks = random_blocks(QType.Q4_K, 4, 256, seed=1)
    weight = QuantizedWeight(torch.from_numpy(blocks), QType.Q4_K, 256)
    assert not int8_applies(weight)
    with pytest.raises(ValueError, match="no int8 route for Q4_K"):
        quant_linear_int8(torch.randn(3, 256), weight)
    set_isa(Isa.PORTABLE)  # the portable build has no route at all
    assert int8_isa() == Int8Isa.NONE
    q8 = QuantizedWeight(torch.from_numpy(random_blocks(QType.Q8_0, 4, 64, seed=1)), QType.Q8_0, 64)
    assert not int8_applies(q8)
    with pytest.raises(ValueError, match="no int8 route"):
        quant_linear_int8(torch.randn(3, 64), q8)


def test_the_route_follows_the_cpu():
    """VNNI on AVX-512 CPUs that have it, maddubs on AVX2 (and AVX-512 without VNNI)."""
    from engine.config.cpu_dtype import cpu_flags

    flags = cpu_flags()
    expected = Int8Isa.NONE
    if Isa.AVX512 in available_isas():
        expected = Int8Isa.AVX512_VNNI if "avx512_vnni" in flags else Int8Isa.AVX2
    elif Isa.AVX2 in available_isas():
        expected = Int8Isa.AVX2
    assert int8_isa() == expected
    if Isa.AVX2 in available_isas():
        set_isa(Isa.AVX2)
        assert int8_isa() == Int8Isa.AVX2
