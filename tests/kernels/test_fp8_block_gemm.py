"""The block-scaled FP8 GEMM (kernels/fp8_block_gemm.py) against the float64 product of the
activations and the block-dequantized weight: decode rows and prefill rows, N and K that
leave ragged edge blocks and partial tiles, blocks of 128 x 128 and the tests' odd ones
(32 x 48: K steps of 16; 24 x 32: a tile spans row blocks), every config that fits; in the
interpreter without a GPU.

The bound: W8A16 does not round the activations or the weights (E4M3 is exact in each
dtype), so only fp32 roundings are left (the dots' accumulation, a multiply and an add per
K step: K + K / 16 + 4 units of 2^-23 of sum |x| |W|, generously) and the output's."""

from __future__ import annotations

import math

import pytest
import torch

from kernels._common import is_interpreter
from kernels.fp8_block_gemm import (
    FP8_DTYPE,
    GPU_CONFIGS,
    BlockGemmConfig,
    candidate_configs,
    fp8_block_gemm,
    kernel_takes_block,
    max_block_k,
    ref_fp8_block_gemm,
    row_bucket,
)
from tests.kernels._helpers import device, pick
from tests.triton_utils import import_triton

import_triton()

# The interpreter mis-rounds bf16: fp16 and fp32 there, bf16 (the served dtype) on a GPU.
GEMM_DTYPES = pick([torch.float16, torch.float32], [torch.bfloat16])
OUTPUT_ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _operands(m, n, k, block, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(FP8_DTYPE)
    grid = (math.ceil(n / block[0]), math.ceil(k / block[1]))
    scale = torch.rand(grid, generator=gen) * 0.01 + 1e-3  # a different scale per block
    x = torch.randn(m, k, generator=gen).to(dtype)
    return x.to(device()), weight.to(device()), scale.to(device())


def _check_within_bounds(out, x, weight, scale, block) -> None:
    expected = ref_fp8_block_gemm(x, weight, scale, block).cpu()  # float64
    n, k = weight.shape
    spread = scale.double().cpu().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)
    w = weight.double().cpu() * spread[:, :k]
    magnitude = x.double().abs().cpu() @ w.abs().T  # sum_k |x| |W|
    bound = expected.abs() * OUTPUT_ULP[out.dtype] + magnitude * (k + k // 16 + 4) * 2.0**-23
    error = (out.double().cpu() - expected).abs()
    assert bool((error <= bound + 1e-12).all()), (error - bound).max()


@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 40, 130])
@pytest.mark.parametrize("block", [(128, 128), (32, 48), (24, 32)], ids=str)
def test_autotuned_matches_float64(dtype, m, block) -> None:
    """What the autotuner runs (the interpreter: the first config that fits); N and K are
    not multiples of any block (ragged edge blocks) nor of the tiles."""
    n, k = pick(72, 4096 + 72), pick(200, 4096 + 208)
    x, weight, scale = _operands(m, n, k, block, dtype, seed=m)
    out = fp8_block_gemm(x, weight, scale, block)
    assert out.shape == (m, n) and out.dtype == dtype
    _check_within_bounds(out, x, weight, scale, block)


@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=str)
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=str)
@pytest.mark.parametrize("k", [192, 200], ids=["k-even", "k-tail"])
def test_every_config_matches_float64(dtype, config, k) -> None:
    """Each candidate at 20 rows in blocks of 64 x 128 / 32 (whichever its K step fits):
    K = 192 whole steps for most (the unmasked loads), 200 a partial last one."""
    block = (64, 128) if config.block_k > 32 else (40, 32)
    assert config.fits(row_bucket(20), block[1])
    x, weight, scale = _operands(20, 136, k, block, dtype, seed=k)
    out = fp8_block_gemm(x, weight, scale, block, config=config)
    _check_within_bounds(out, x, weight, scale, block)


def test_scales_are_applied_per_block() -> None:
    """Scaling one block's scale by 2 doubles exactly that block's part of the product."""
    block = (16, 32)
    x, weight, scale = _operands(2, 48, 96, block, torch.float32, seed=5)
    base = fp8_block_gemm(x, weight, scale, block).double()
    scale2 = scale.clone()
    scale2[1, 2] *= 2
    delta = fp8_block_gemm(x, weight, scale2, block).double() - base
    part = x[:, 64:96].double() @ (weight[16:32, 64:96].double() * float(scale[1, 2])).T
    expected = torch.zeros_like(delta)
    expected[:, 16:32] = part
    torch.testing.assert_close(delta, expected, atol=1e-5, rtol=1e-4)


def test_blocks_and_buckets() -> None:
    assert [row_bucket(m) for m in (1, 16, 17, 33, 64, 65, 4096)] == [16, 16, 32, 64, 64, 128, 128]
    assert [max_block_k(c) for c in (128, 256, 48, 32, 40, 8)] == [128, 128, 16, 32, 0, 0]
    assert kernel_takes_block((128, 128)) and kernel_takes_block((7, 48))
    assert not kernel_takes_block((128, 40)) and not kernel_takes_block((0, 128))
    first = candidate_configs(16, 48)
    assert first and all(48 % c.block_k == 0 for c in first)
    if is_interpreter():
        assert len(first) == 1


def test_candidates_on_a_gpu(monkeypatch) -> None:
    """What a GPU's autotuner times: every config whose K step divides the block's columns
    and whose accumulator fits its warps."""
    monkeypatch.setattr("kernels.fp8_block_gemm.is_interpreter", lambda: False)
    decode = candidate_configs(16, 128)
    assert decode == [c for c in GPU_CONFIGS if c.block_k >= 64]
    prefill = candidate_configs(128, 128)
    assert prefill and all(128 * c.block_n <= 2048 * c.num_warps for c in prefill)
    assert all(c.block_k == 16 for c in candidate_configs(16, 48))


def test_empty_and_bad_operands() -> None:
    block = (32, 32)
    x, weight, scale = _operands(3, 40, 64, block, torch.float32, seed=0)
    assert fp8_block_gemm(x[:0], weight, scale, block).shape == (0, 40)
    with pytest.raises(ValueError, match="weight must have dtype"):
        fp8_block_gemm(x, weight.float(), scale, block)
    with pytest.raises(ValueError, match=r"weight_scale must be the block grid \[2, 2\]"):
        fp8_block_gemm(x, weight, scale[:1].contiguous(), block)
    with pytest.raises(ValueError, match="weight_scale must have dtype"):
        fp8_block_gemm(x, weight, scale.half(), block)
    with pytest.raises(ValueError, match="block_size must be"):
        fp8_block_gemm(x, weight, scale, (32, 40))
    with pytest.raises(ValueError, match="x has 32 columns"):
        fp8_block_gemm(x[:, :32].contiguous(), weight, scale, block)
    with pytest.raises(ValueError, match="does not fit"):
        fp8_block_gemm(x, weight, scale, block, config=BlockGemmConfig(64, 64))
