"""The quantized linear kernels (engine/native/quant_kernels.c) against gguf-py's dequantize
followed by an fp32 matmul, over a grid of shapes, every block type and every ISA path this
CPU runs (each forced in turn, and compared with each other)."""

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
    Isa,
    QType,
    QuantizedWeight,
    active_isa,
    available_isas,
    quant_linear,
    quantize_int8,
    set_isa,
)
from tests.engine.gguf_files import random_blocks  # noqa: E402

GGUF_TYPES = [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q6_K]


def reference_weight(qtype: QType, blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, GT(int(qtype))).astype(np.float32))


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    set_isa(None)


def test_isa_paths_listed_and_forcing_an_unavailable_one_fails():
    isas = available_isas()
    assert Isa.PORTABLE in isas
    assert active_isa() == max(isas)
    for isa in Isa:
        if isa not in isas:
            with pytest.raises(ValueError, match=isa.name):
                set_isa(isa)


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("out_features", "blocks_per_row"), [(1, 1), (7, 3), (33, 2), (130, 5)])
def test_dequantize_matches_gguf(qtype, out_features, blocks_per_row):
    cols = blocks_per_row * BLOCK_SIZES[qtype][0]
    blocks = random_blocks(qtype, out_features, cols, seed=out_features)
    weight = QuantizedWeight(torch.from_numpy(blocks), qtype, cols)
    expected = reference_weight(qtype, blocks)
    for isa in available_isas():
        set_isa(isa)
        torch.testing.assert_close(weight.dequantize(), expected, rtol=0, atol=0)
        start = min(3, out_features)
        torch.testing.assert_close(weight.dequantize(start, out_features), expected[start:])


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 5])
@pytest.mark.parametrize(("out_features", "blocks_per_row"), [(1, 2), (29, 3), (97, 1)])
def test_linear_matches_dequantize_then_matmul(qtype, rows, out_features, blocks_per_row):
    cols = blocks_per_row * BLOCK_SIZES[qtype][0]
    blocks = random_blocks(qtype, out_features, cols, seed=rows * 1000 + out_features)
    weight = QuantizedWeight(torch.from_numpy(blocks), qtype, cols)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    reference = reference_weight(qtype, blocks).double()
    expected = x.double() @ reference.T + bias.double()
    # fp32 rounding of a sum grows with the sum of the terms' magnitudes, not with the result:
    # the paths (AVX-512, AVX2, portable) add in different orders, so each must be within a
    # few float32 epsilons of that magnitude from the exact result (measured: under 2), and so
    # within twice that of each other. A wrong block decode is off by far more. (A fixed
    # tolerance on the result fails where terms of ~2e4 cancel to ~0.4: the portable build
    # without FMA for x86-64 was off by 1.8e-4 there, 0.4 epsilons of the magnitude.)
    magnitude = x.double().abs() @ reference.abs().T + bias.double().abs()
    bound = 4 * torch.finfo(torch.float32).eps * magnitude
    results = {}
    for isa in available_isas():
        set_isa(isa)
        results[isa] = quant_linear(x, weight, bias).double()
        error = (results[isa] - expected).abs()
        assert (error <= bound).all(), (isa.name, (error / bound).max().item())
    paths = list(results.items())
    for isa, other in paths[1:]:  # the ISA paths agree with each other to fp32 rounding
        assert ((other - paths[0][1]).abs() <= 2 * bound).all(), (isa.name, paths[0][0].name)


@pytest.mark.parametrize("qtype", [*GGUF_TYPES, QType.INT8], ids=lambda t: t.name)
def test_gemv_decodes_every_weight_exactly(qtype):
    """One-hot activation rows pick single weights out of the GEMV: x = e_j gives W[:, j]
    with nothing to round (the other products are exact zeros), so every path's in-register
    decoding (AVX-512's nibble table, AVX2's conversions, the portable loop) must reproduce
    gguf-py's dequantized values bit for bit, not just within a tolerance."""
    out_features, cols = 37, 2 * BLOCK_SIZES[qtype][0] if qtype != QType.INT8 else 64
    if qtype == QType.INT8:
        weight = quantize_int8(torch.randn(out_features, cols, generator=torch.Generator()))
        expected = weight.dequantize()
    else:
        blocks = random_blocks(qtype, out_features, cols, seed=7)
        weight = QuantizedWeight(torch.from_numpy(blocks), qtype, cols)
        expected = reference_weight(qtype, blocks)
    eye = torch.eye(cols)
    for isa in available_isas():
        set_isa(isa)
        for start in range(0, cols, GEMV_MAX_ROWS):  # GEMV calls of up to 16 one-hot rows
            got = quant_linear(eye[start : start + GEMV_MAX_ROWS], weight)  # [rows, out]
            torch.testing.assert_close(
                got, expected[:, start : start + GEMV_MAX_ROWS].T, rtol=0, atol=0, msg=isa.name
            )


def test_linear_strided_and_batched_activations():
    blocks = random_blocks(QType.Q4_1, 40, 64, seed=1)
    weight = QuantizedWeight(torch.from_numpy(blocks), QType.Q4_1, 64)
    x = torch.randn(2, 3, 128)[..., ::2]  # [2, 3, 64], non-unit last stride
    expected = x @ reference_weight(QType.Q4_1, blocks).T
    torch.testing.assert_close(quant_linear(x, weight), expected, rtol=1e-4, atol=1e-4)
    wide = torch.randn(5, 100)[:, 10:74]  # unit last stride, row stride 100
    torch.testing.assert_close(
        quant_linear(wide, weight),
        wide @ reference_weight(QType.Q4_1, blocks).T,
        rtol=1e-4,
        atol=1e-4,
    )


@pytest.mark.parametrize("rows", [1, 4, GEMV_MAX_ROWS + 1])
@pytest.mark.parametrize(("out_features", "cols"), [(1, 1), (19, 45), (64, 576)])
def test_int8_per_channel(rows, out_features, cols):
    generator = torch.Generator().manual_seed(cols)
    w = torch.randn(out_features, cols, generator=generator)
    w[0] = 0.0  # an all-zero row must not divide by zero
    weight = quantize_int8(w)
    twin = weight.dequantize()  # the fp32 weight the int8 one stands for
    assert (twin - w).abs().max() <= weight.scales.max() / 2 + 1e-6
    q = weight.data.view(torch.int8).float()
    torch.testing.assert_close(twin, q * weight.scales[:, None])
    assert q.abs().max() <= 127
    x = torch.randn(rows, cols, generator=generator)
    expected = x.double() @ twin.double().T
    for isa in available_isas():
        set_isa(isa)
        torch.testing.assert_close(quant_linear(x, weight).double(), expected, rtol=1e-4, atol=1e-4)


def test_bad_inputs_name_the_problem():
    blocks = random_blocks(QType.Q8_0, 4, 64, seed=0)
    with pytest.raises(ValueError, match="multiple of the Q8_0 block size"):
        QuantizedWeight(torch.from_numpy(blocks), QType.Q8_0, 60)
    with pytest.raises(ValueError, match="take 68 bytes"):
        QuantizedWeight(torch.from_numpy(blocks[:, :34]), QType.Q8_0, 64)
    weight = QuantizedWeight(torch.from_numpy(blocks), QType.Q8_0, 64)
    with pytest.raises(ValueError, match="in_features"):
        quant_linear(torch.randn(2, 32), weight)
    with pytest.raises(ValueError, match="fp32"):
        quant_linear(torch.randn(2, 64, dtype=torch.float64), weight)


def _load_with(value: str) -> tuple[int, str]:
    """The library loaded anew with $PAGEDSERVE_QUANT_ISA=`value`, in a child forked from
    this process (torch imported already: two interpreter starts were this test's time):
    (0, the active path's name) or (1, the error). The child's load is the first in its
    process as far as `engine.native.quant` can tell (its cached library cleared), and the
    path it forces stays in the child."""
    import os
    import select
    import signal

    from engine.native import quant

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest cleanup, no OpenMP (only the ctypes set/get calls)
        os.close(read)
        code = 1
        try:
            os.environ[quant.QUANT_ISA_ENV] = value
            quant._lib.cache_clear()
            answer, code = quant.active_isa().name, 0
        except BaseException as exc:
            answer = f"{type(exc).__name__}: {exc}"
        os.write(write, answer.encode())
        os._exit(code)
    os.close(write)
    if not select.select([read], [], [], 120)[0]:  # a hang fails the test, not the run
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)
        raise AssertionError(f"the load with {value!r} hangs")
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), answer


def test_isa_forced_by_environment():
    """$PAGEDSERVE_QUANT_ISA picks the path at load; a bad value names the variable."""
    assert _load_with("portable") == (0, "PORTABLE")
    code, error = _load_with("sse9")
    assert code != 0
    assert error.startswith("ValueError") and "PAGEDSERVE_QUANT_ISA" in error
