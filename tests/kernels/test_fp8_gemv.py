"""The FP8 GEMV (kernels/fp8_gemv.py) against the float64 product of the activations and the
dequantized weight: per-tensor and per-channel scales, 1..16 rows (and past 16: the taller
tiles), N and K that leave partial tiles, the one-row FMA path and the tensor-core path,
splits over K summed in a fixed order; in the interpreter without a GPU.

The bound: the kernel does not quantize the activations (W8A16), so only the fp32
accumulation (K * 2^-23 of sum |x| |W|, generously) and the output's rounding are left. That
bound lies inside the FP8 layer's (tests/engine/layers/test_fp8_linear.py: the activations'
FP8 rounding on top), which is asserted too."""

from __future__ import annotations

import pytest
import torch

from kernels._common import is_interpreter
from kernels.fp8_gemv import (
    FP8_DTYPE,
    GPU_CONFIGS,
    Fp8GemvConfig,
    _even_k,
    candidate_configs,
    fp8_gemv,
    ref_fp8_gemv,
    row_bucket,
)
from tests.kernels._helpers import device, pick
from tests.triton_utils import import_triton

import_triton()

# The interpreter: fp16 and fp32 (it mis-rounds bf16); a GPU: bf16, the served dtype, alone
# (each dtype compiles every autotune config again: tens of seconds of the GPU check).
GEMV_DTYPES = pick([torch.float16, torch.float32], [torch.bfloat16])
OUTPUT_ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
FP8_REL, FP8_SUBNORMAL_ABS = 2.0**-4, 2.0**-10  # the FP8 layer test's activation rounding


def _operands(m: int, n: int, k: int, dtype: torch.dtype, per_channel: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(FP8_DTYPE)
    scale = torch.rand(n if per_channel else 1, generator=gen) * 0.01 + 1e-3
    x = torch.randn(m, k, generator=gen).to(dtype)
    return x.to(device()), weight.to(device()), scale.to(device())


def _check_within_bounds(out, x, weight, scale) -> None:
    expected = ref_fp8_gemv(x, weight, scale)  # float64
    w = (weight.double() * scale.double().reshape(-1, 1)).cpu()
    magnitude = x.double().abs().cpu() @ w.abs().T  # sum_k |x| |W|
    k = x.shape[1]
    bound = expected.abs().cpu() * OUTPUT_ULP[out.dtype] + magnitude * (k + 2) * 2.0**-23
    error = (out.double().cpu() - expected.cpu()).abs()
    assert bool((error <= bound + 1e-12).all()), (error - bound).max()
    # the FP8 layer's bound (per-token activation rounding, then the output's) is looser
    x_scale = x.double().abs().amax(dim=1, keepdim=True).cpu() / 448.0
    layer_bound = (x.double().abs().cpu() * FP8_REL + FP8_SUBNORMAL_ABS * x_scale) @ w.abs().T
    assert bool((bound <= layer_bound + expected.abs().cpu() * OUTPUT_ULP[out.dtype]).all())


@pytest.mark.parametrize("dtype", GEMV_DTYPES, ids=str)
@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
@pytest.mark.parametrize("m", [*range(1, 17), 17, 40])
def test_autotuned_matches_float64(dtype, per_channel, m) -> None:
    """The configs the autotuner would run (in the interpreter, the first that fits)."""
    # not multiples of any block; on a GPU multiples of 16, as the served shapes (the
    # compiled kernels are then shared with them)
    n, k = pick(40, 6144 + 48), pick(200, 4096 + 208)
    x, weight, scale = _operands(m, n, k, dtype, per_channel, seed=m)
    out = fp8_gemv(x, weight, scale)
    assert out.shape == (m, n) and out.dtype == dtype
    _check_within_bounds(out, x, weight, scale)


@pytest.mark.parametrize("dtype", GEMV_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("m", "config"),
    [
        (1, Fp8GemvConfig(16, 64, 1, dot=False)),
        (1, Fp8GemvConfig(32, 32, 3, dot=False)),  # three splits, the last one short
        (1, Fp8GemvConfig(16, 32, 2, dot=True)),  # one row in a 16-row tile
        (4, Fp8GemvConfig(32, 64, 4, dot=True)),  # more splits than K needs: one is empty
        (16, Fp8GemvConfig(16, 32, 1, dot=True)),
        (33, Fp8GemvConfig(32, 32, 1, dot=True)),  # 64-row tiles
    ],
    ids=["fma", "fma-split3", "dot-1row-split2", "dot-split4", "dot-16", "dot-64rows"],
)
@pytest.mark.parametrize("k", [190, 256], ids=["k-tail", "k-even"])
def test_every_tile_shape_matches_float64(dtype, m, config, k) -> None:
    """K = 190 leaves a partial step (masked loads); K = 256 whole steps in most of these
    configs (`EVEN_K`: the unmasked loads the GPU vectorizes)."""
    x, weight, scale = _operands(m, 24, k, dtype, per_channel=True, seed=7 * m)
    out = fp8_gemv(x, weight, scale, config=config)
    _check_within_bounds(out, x, weight, scale)


def test_even_k_is_whole_steps_in_every_split() -> None:
    assert _even_k({"K": 256, "BLOCK_K": 64, "SPLIT_K": 2})
    assert not _even_k({"K": 256, "BLOCK_K": 32, "SPLIT_K": 3})
    assert not _even_k({"K": 190, "BLOCK_K": 64, "SPLIT_K": 1})
    assert _even_k({"K": 14336, "BLOCK_K": 512, "SPLIT_K": 2})  # Llama-3.1-8B's down_proj


def test_splits_are_summed_in_a_fixed_order() -> None:
    """The same call twice gives the same bits (no atomics)."""
    x, weight, scale = _operands(2, 24, 190, torch.float32, per_channel=False, seed=3)
    config = Fp8GemvConfig(16, 32, 3, dot=True)
    first = fp8_gemv(x, weight, scale, config=config)
    assert torch.equal(first, fp8_gemv(x, weight, scale, config=config))


def test_candidates_follow_the_bucket_and_k(monkeypatch) -> None:
    """What a GPU's autotuner times: FMA configs for one row only, splits only at <= 16 rows
    and on a long K; the interpreter (which cannot time) takes the first."""
    assert [row_bucket(m) for m in (1, 2, 16, 17, 32, 33, 500)] == [1, 16, 16, 32, 32, 64, 64]
    assert len(candidate_configs(1, 14336)) == (1 if is_interpreter() else len(GPU_CONFIGS))
    monkeypatch.setattr("kernels.fp8_gemv.is_interpreter", lambda: False)
    one_row = candidate_configs(1, 14336)
    assert one_row == list(GPU_CONFIGS)  # everything fits one row of a long K
    for bucket in (16, 32, 64):
        got = candidate_configs(bucket, 14336)
        assert got and all(c.dot for c in got)
        assert any(c.split_k > 1 for c in got) == (bucket == 16)
    assert all(c.split_k == 1 for c in candidate_configs(1, 256))  # too short to split


def test_empty_and_bad_operands() -> None:
    x, weight, scale = _operands(3, 24, 64, torch.float32, per_channel=True, seed=0)
    assert fp8_gemv(x[:0], weight, scale).shape == (0, 24)
    with pytest.raises(ValueError, match="weight must have dtype"):
        fp8_gemv(x, weight.float(), scale)
    with pytest.raises(ValueError, match="weight_scale must have 1"):
        fp8_gemv(x, weight, scale[:5].contiguous())
    with pytest.raises(ValueError, match="x has 32 columns"):
        fp8_gemv(x[:, :32].contiguous(), weight, scale)
    with pytest.raises(ValueError, match="takes one row"):
        fp8_gemv(x, weight, scale, config=Fp8GemvConfig(16, 32, 1, dot=False))
