"""The W8A8 block-scaled FP8 GEMM (kernels/fp8_block_w8a8.py) in the interpreter without a
GPU (it runs fp8 x fp8 `tl.dot`): 1 to 300 rows, N and K that leave ragged edge blocks and
partial tiles, blocks of 128 x 128 and smaller (32 x 64; 24 x 32: a tile spans row blocks,
K steps of 32), every config that fits, against two float64 references:

- the product of the same quantized operands (activations per token and block column,
  kernels/fp8_group_quant.py): only the kernel's own roundings are left. In the
  interpreter those are fp32's (each K step's dot, two scale multiplies and an add per
  step: K + K / 32 + 8 units of 2^-23 of sum |a| |W|, generously) and the output's. On a
  GPU the FP8 MMA accumulates a step in fewer bits (about 14, DeepSeek-V3's report), so
  there the bound is a step of 128 products at 2^-13 each: an assumed worst case, not one
  measured here.
- the unquantized product (x times the dequantized weight, what the W8A16 GEMM computes):
  within FP8's error on the activations, half an E4M3 step per value (2^-4 of |x|, or
  2^-10 of the group's scale below the normal range), weighted by |W|; and not equal to
  it (the activations really were quantized)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels._common import is_interpreter
from kernels.fp8_block_gemm import ref_fp8_block_gemm
from kernels.fp8_block_w8a8 import (
    FP8_DTYPE,
    GPU_CONFIGS,
    W8A8Config,
    candidate_configs,
    fp8_block_w8a8,
    fp8_block_w8a8_quantized,
    m_bucket,
    ref_fp8_block_w8a8,
    w8a8_block_k,
    w8a8_takes_block,
)
from kernels.fp8_group_quant import quantize_per_token_group_fp8
from tests.kernels._helpers import device, full_size, pick
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
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, m)[:, None]
    x[:, 3] *= 50  # an outlier column: its groups get coarser scales than the others
    return x.to(dtype).to(device()), weight.to(device()), scale.to(device())


def _dequantized_weight(weight, scale, block):
    n, k = weight.shape
    spread = scale.double().cpu().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)
    return weight.double().cpu() * spread[:, :k]


def _kernel_bound(a_abs, w_abs, expected, k, out_dtype):
    """What the kernel's own roundings may cost (see the module doc)."""
    magnitude = a_abs @ w_abs.T
    accumulation = 128 * 2.0**-13 if full_size() else k * 2.0**-23
    rounding = accumulation + (k // 32 + 8) * 2.0**-23
    return expected.abs() * OUTPUT_ULP[out_dtype] + magnitude * rounding + 1e-12


def _check(out, x, weight, scale, block) -> None:
    a, a_scale = quantize_per_token_group_fp8(x, block[1])
    expected = ref_fp8_block_w8a8(a, a_scale, weight, scale, block).cpu()  # float64
    k = weight.shape[1]
    a_deq = a.double().cpu() * a_scale.double().cpu().repeat_interleave(block[1], 1)[:, :k]
    w_abs = _dequantized_weight(weight, scale, block).abs()
    got = out.double().cpu()
    bound = _kernel_bound(a_deq.abs(), w_abs, expected, k, out.dtype)
    assert bool(((got - expected).abs() <= bound).all()), ((got - expected).abs() - bound).max()
    # Against the unquantized activations: FP8's half step per value on top.
    exact = ref_fp8_block_gemm(x, weight, scale, block).cpu()
    spread = a_scale.double().cpu().repeat_interleave(block[1], 1)[:, :k]
    step = x.double().cpu().abs() * 2.0**-4 + spread * 2.0**-10
    fp8_bound = step @ w_abs.T + bound + exact.abs() * OUTPUT_ULP[out.dtype]
    assert bool(((got - exact).abs() <= fp8_bound).all())
    assert not torch.equal(got, exact.to(out.dtype).double())  # activations were quantized


@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 17, 64, 130, 300])
@pytest.mark.parametrize("block", [(128, 128), (32, 64), (24, 32)], ids=str)
def test_autotuned_matches_float64(dtype, m, block) -> None:
    """What the autotuner runs (the interpreter: the first config that fits); N and K are
    not multiples of any block (ragged edge blocks) nor of the tiles."""
    n, k = pick(72, 4096 + 72), pick(200, 4096 + 208)
    x, weight, scale = _operands(m, n, k, block, dtype, seed=m)
    out = fp8_block_w8a8(x, weight, scale, block)
    assert out.shape == (m, n) and out.dtype == dtype
    _check(out, x, weight, scale, block)


@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=str)
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=str)
@pytest.mark.parametrize("k", [256, 224], ids=["k-even", "k-tail"])
def test_every_config_matches_float64(dtype, config, k) -> None:
    """Each candidate at 40 rows in blocks of 64 x 128 / 32 (whichever its K step fits):
    K = 256 whole steps (the unmasked loads), 224 a partial last one for the 128-steps (a
    config that takes no K tail is refused it, by name)."""
    block = (64, 128) if config.block_k > 32 else (40, 32)
    x, weight, scale = _operands(40, 136, k, block, dtype, seed=k)
    if not config.fits(m_bucket(40), block[1], k % config.block_k == 0):
        assert k % config.block_k and not config.ragged_k
        with pytest.raises(ValueError, match="does not fit"):
            fp8_block_w8a8(x, weight, scale, block, config=config)
        return
    out = fp8_block_w8a8(x, weight, scale, block, config=config)
    _check(out, x, weight, scale, block)


def test_scales_are_applied_per_block_and_group() -> None:
    """Doubling one weight block's scale doubles exactly that block's part of the product;
    doubling one row's activation scale of one group, that row's part over the group."""
    block = (16, 32)
    x, weight, scale = _operands(3, 48, 96, block, torch.float32, seed=5)
    a, a_scale = quantize_per_token_group_fp8(x, 32)
    base = fp8_block_w8a8_quantized(a, a_scale, weight, scale, block, torch.float32).double()
    a_deq = a.double() * a_scale.double().repeat_interleave(32, 1)
    scale2 = scale.clone()
    scale2[1, 2] *= 2
    delta = fp8_block_w8a8_quantized(a, a_scale, weight, scale2, block, torch.float32)
    expected = torch.zeros_like(base)
    expected[:, 16:32] = a_deq[:, 64:96] @ (weight[16:32, 64:96].double() * float(scale[1, 2])).T
    torch.testing.assert_close(delta.double() - base, expected, atol=1e-5, rtol=1e-4)
    a_scale2 = a_scale.clone()
    a_scale2[2, 1] *= 2
    delta = fp8_block_w8a8_quantized(a, a_scale2, weight, scale, block, torch.float32)
    expected = torch.zeros_like(base)
    w_deq = weight.double() * scale.double().repeat_interleave(16, 0).repeat_interleave(32, 1)
    expected[2] = a_deq[2, 32:64] @ w_deq[:, 32:64].T
    torch.testing.assert_close(delta.double() - base, expected, atol=1e-5, rtol=1e-4)


def test_blocks_and_buckets() -> None:
    assert [m_bucket(m) for m in (1, 16, 17, 64, 65, 200, 4096)] == [16, 16, 32, 64, 128, 256, 256]
    assert [w8a8_block_k(c) for c in (128, 256, 96, 64, 32, 48, 16)] == [128, 128, 32, 64, 32, 0, 0]
    assert w8a8_takes_block((128, 128)) and w8a8_takes_block((7, 96))
    assert not w8a8_takes_block((32, 48)) and not w8a8_takes_block((0, 128))
    first = candidate_configs(16, 96)
    assert first and all(96 % c.block_k == 0 for c in first)
    if is_interpreter():
        assert len(first) == 1


def test_candidates_on_a_gpu(monkeypatch) -> None:
    """What a GPU's autotuner times: every config whose K step divides the block's columns,
    whose accumulator fits its warps, and which takes the K tail where there is one."""
    monkeypatch.setattr("kernels.fp8_block_w8a8.is_interpreter", lambda: False)
    prefill = candidate_configs(256, 128, 4096)
    assert prefill == [c for c in GPU_CONFIGS if c.block_k >= 64]
    ragged = candidate_configs(256, 128, 4096 + 64)
    assert ragged and not any(c.block_k == 128 and not c.ragged_k for c in ragged)
    assert all(c.block_k == 32 for c in candidate_configs(64, 96))


def test_empty_and_bad_operands() -> None:
    block = (32, 32)
    x, weight, scale = _operands(3, 40, 64, block, torch.float32, seed=0)
    assert fp8_block_w8a8(x[:0], weight, scale, block).shape == (0, 40)
    a, a_scale = quantize_per_token_group_fp8(x, 32)
    with pytest.raises(ValueError, match=r"block_size must be .* multiple of 32"):
        fp8_block_w8a8(x, weight, scale, (32, 48))
    with pytest.raises(ValueError, match="weight must have dtype"):
        fp8_block_w8a8(x, weight.float(), scale, block)
    with pytest.raises(ValueError, match=r"weight_scale must be the block grid \[2, 2\]"):
        fp8_block_w8a8(x, weight, scale[:1].contiguous(), block)
    with pytest.raises(ValueError, match="a has 32 columns"):
        fp8_block_w8a8(x[:, :32].contiguous(), weight, scale, block)
    with pytest.raises(ValueError, match="a must have dtype"):
        fp8_block_w8a8_quantized(x, a_scale, weight, scale, block, torch.float32)
    with pytest.raises(ValueError, match=r"a_scale must be \[M, groups\] = \[3, 2\]"):
        fp8_block_w8a8_quantized(a, a_scale[:, :1], weight, scale, block, torch.float32)
    with pytest.raises(ValueError, match="a_scale must have dtype"):
        fp8_block_w8a8_quantized(a, a_scale.double(), weight, scale, block, torch.float32)
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        fp8_block_w8a8_quantized(a, a_scale, weight, scale, block, torch.int32)
    with pytest.raises(ValueError, match="does not fit"):
        fp8_block_w8a8(x, weight, scale, block, config=W8A8Config(64, 64, 64))
