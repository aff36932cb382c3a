"""The W8A8 grouped GEMM of block-scaled FP8 experts (kernels/fused_moe_fp8_w8a8.py) in the
interpreter: gathered rows over experts with and without rows, one ungathered row, a
64-row tile, blocks 32 x 32 and 24 x 64 (rows span row blocks, K steps of 64 and a ragged
K), every config, against the float64 product of the same quantized operands (the dense
W8A8 GEMM's bound, tests/kernels/test_fp8_block_w8a8.py) and within FP8's activation error
of the W8A16 kernel's exact value; bad operands named."""

from __future__ import annotations

import pytest
import torch

from engine.layers.moe import select_experts, sort_rows
from kernels.fp8_block_w8a8 import GPU_CONFIGS, W8A8Config
from kernels.fp8_group_quant import dequantize_groups_float64, quantize_per_token_group_fp8
from kernels.fused_moe_fp8 import dequantize_experts, moe_row_bucket, ref_fp8_moe_grouped_gemm
from kernels.fused_moe_fp8_w8a8 import fp8_moe_w8a8, fp8_moe_w8a8_quantized
from tests.kernels._helpers import device, full_size, pick
from tests.triton_utils import import_triton

import_triton()

GEMM_DTYPES = pick([torch.float16, torch.float32], [torch.bfloat16])
OUTPUT_ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _problem(num_tokens, num_experts, top_k, n, k, block, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=gen) * torch.logspace(-2, 1, num_tokens)[:, None]
    weight = (torch.randn(num_experts, n, k, generator=gen) * 64).clamp(-448, 448)
    grid = (num_experts, -(-n // block[0]), -(-k // block[1]))
    scale = torch.rand(grid, generator=gen) * 0.01 + 1e-3
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    rows = sort_rows(*select_experts(logits, top_k, renormalize=True), num_experts)
    dev = device()
    return x.to(dtype).to(dev), weight.to(torch.float8_e4m3fn).to(dev), scale.to(dev), rows


def _per_expert(gathered, real, offsets):
    out = torch.zeros(gathered.shape[0], real.shape[1], dtype=torch.float64)
    for e in range(real.shape[0]):
        a, b = offsets[e], offsets[e + 1]
        out[a:b] = gathered[a:b] @ real[e].T
    return out


def _check(out, x, rows, weight, scale, offsets, block) -> None:
    a, a_scale = quantize_per_token_group_fp8(x, block[1])
    a_deq = dequantize_groups_float64(a.cpu(), a_scale.cpu(), block[1])
    pick_rows = (lambda t: t) if rows is None else (lambda t: t[rows.cpu()])
    real = dequantize_experts(weight, scale, block).cpu()
    expected = _per_expert(pick_rows(a_deq), real, offsets)
    magnitude = _per_expert(pick_rows(a_deq).abs(), real.abs(), offsets)
    k = weight.shape[2]
    accumulation = 128 * 2.0**-13 if full_size() else k * 2.0**-23
    bound = expected.abs() * OUTPUT_ULP[out.dtype] + magnitude * (
        accumulation + (k // 32 + 8) * 2.0**-23
    )
    got = out.double().cpu()
    assert bool(((got - expected).abs() <= bound + 1e-12).all())
    exact = ref_fp8_moe_grouped_gemm(x, rows, weight, scale, offsets, block).cpu()
    spread = a_scale.double().cpu().repeat_interleave(block[1], 1)[:, :k]
    step = x.double().cpu().abs() * 2.0**-4 + spread * 2.0**-10
    fp8_bound = _per_expert(pick_rows(step), real.abs(), offsets) + bound
    assert bool(((got - exact).abs() <= fp8_bound + exact.abs() * OUTPUT_ULP[out.dtype]).all())


# (tokens, experts, top_k, n, k, block): 3 tokens x top-2 of 8 leave experts without rows.
CASES = [(3, 8, 2, 40, 80, (32, 32)), (20, 4, 2, 40, 136, (24, 64))]


@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_autotuned_matches_float64(case, dtype) -> None:
    *shape, block = case
    x, weight, scale, rows = _problem(*shape, block, dtype, seed=shape[0])
    rows_dev = rows.token.to(x.device)
    out = fp8_moe_w8a8(x, rows_dev, weight, scale, rows.offsets, block)
    assert out.shape == (rows.offsets[-1], shape[3]) and out.dtype == dtype
    _check(out, x, rows_dev, weight, scale, rows.offsets, block)


@pytest.mark.parametrize("config", GPU_CONFIGS, ids=str)
def test_every_config_at_wide_tiles(config) -> None:
    """40 rows for one expert (64-row tiles), not gathered, blocks of 32 x 128 (K steps of
    128 where the config takes them; 32 for the narrowest config's 32-column blocks)."""
    block = (32, 128) if config.block_k > 32 else (32, 32)
    x, weight, scale, _ = _problem(40, 2, 1, 40, 256, block, torch.float32, seed=3)
    offsets = [0, 40, 40]
    assert moe_row_bucket(offsets) == 64
    out = fp8_moe_w8a8(x, None, weight, scale, offsets, block, config=config)
    _check(out, x, None, weight, scale, offsets, block)


def test_one_row_and_no_rows() -> None:
    x, weight, scale, _ = _problem(1, 4, 1, 40, 64, (32, 32), torch.float32)
    offsets = [0, 0, 0, 1, 1]  # expert 2's one row
    out = fp8_moe_w8a8(x, None, weight, scale, offsets, (32, 32))
    _check(out, x, None, weight, scale, offsets, (32, 32))
    assert fp8_moe_w8a8(x[:0], None, weight, scale, [0] * 5, (32, 32)).shape == (0, 40)


def test_bad_operands_are_named() -> None:
    x, weight, scale, _ = _problem(2, 2, 1, 40, 64, (32, 32), torch.float32)
    offsets = [0, 1, 2]
    a, a_scale = quantize_per_token_group_fp8(x, 32)
    with pytest.raises(ValueError, match=r"block_size must be .* multiple of 32"):
        fp8_moe_w8a8(x, None, weight, scale, offsets, (32, 48))
    with pytest.raises(ValueError, match=r"block_size must be .* got None"):
        fp8_moe_w8a8(x, None, weight, scale, offsets, None)
    with pytest.raises(ValueError, match=r"weight_scale must be the block grids \[2, 2, 2\]"):
        fp8_moe_w8a8(x, None, weight, scale[:, :1].contiguous(), offsets, (32, 32))
    with pytest.raises(ValueError, match="offsets must be 3 ascending"):
        fp8_moe_w8a8(x, None, weight, scale, [0, 2, 1], (32, 32))
    with pytest.raises(ValueError, match=r"a_scale must be \[num_x_rows, groups\]"):
        fp8_moe_w8a8_quantized(
            a, a_scale[:, :1], None, weight, scale, offsets, (32, 32), torch.float32
        )
    a32, a32_scale = quantize_per_token_group_fp8(x[:, :32].contiguous(), 32)
    with pytest.raises(ValueError, match="a has 32 columns, the weight K=64"):
        fp8_moe_w8a8_quantized(
            a32, a32_scale, None, weight, scale, offsets, (32, 32), torch.float32
        )
    with pytest.raises(ValueError, match="does not fit"):
        fp8_moe_w8a8(x, None, weight, scale, offsets, (32, 32), config=W8A8Config(64, 64, 64))
