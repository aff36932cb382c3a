"""The FP8 experts' grouped GEMM (kernels/fused_moe_fp8.py) against the float64 product of
each sorted row and its expert's dequantized weight: block grids (32 x 32, a ragged one of
24 x 48 whose edges cut N and K), per channel and per tensor; experts without rows, a
single row, gathered and ungathered rows, fp16 / fp32 activations in the interpreter (bf16
on a GPU); in the interpreter without a GPU (small shapes, few cases).

The bound is the dense block GEMM's (tests/kernels/test_fp8_block_gemm.py): W8A16 rounds
neither operand, so only fp32 roundings (K + K / 16 + 4 units of 2^-23 of sum |x| |W|) and
the output's rounding are left."""

from __future__ import annotations

import pytest
import torch

from engine.layers.moe import select_experts, sort_rows
from kernels.fp8_block_gemm import GPU_CONFIGS, BlockGemmConfig
from tests.kernels._helpers import device, pick
from tests.triton_utils import import_triton

import_triton()

from kernels.fused_moe_fp8 import (  # noqa: E402 - after the Triton check
    dequantize_experts,
    fp8_moe_grouped_gemm,
    moe_row_bucket,
    ref_fp8_moe_grouped_gemm,
)

# The interpreter mis-rounds bf16 (DESIGN.md): fp16 and fp32 there, bf16 on a GPU.
GEMM_DTYPES = pick([torch.float16, torch.float32], [torch.bfloat16, torch.float16])
OUTPUT_ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _scales(num_experts, n, k, block, gen):
    if block == "channel":
        return torch.rand(num_experts, n, generator=gen) * 0.01 + 1e-3
    if block == "tensor":
        return torch.rand(num_experts, generator=gen) * 0.01 + 1e-3
    grid = (num_experts, -(-n // block[0]), -(-k // block[1]))
    return torch.rand(grid, generator=gen) * 0.01 + 1e-3  # a different scale per block


def _problem(num_tokens, num_experts, top_k, n, k, block, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=gen).to(dtype)
    weight = (torch.randn(num_experts, n, k, generator=gen) * 64).clamp(-448, 448)
    scale = _scales(num_experts, n, k, block, gen)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    rows = sort_rows(*select_experts(logits, top_k, renormalize=True), num_experts)
    dev = device()
    return x.to(dev), weight.to(torch.float8_e4m3fn).to(dev), scale.to(dev), rows


def _block_size(block):
    return None if block in ("channel", "tensor") else block


def _check(out, x, rows, weight, scale, offsets, block) -> None:
    block_size = _block_size(block)
    expected = ref_fp8_moe_grouped_gemm(x, rows, weight, scale, offsets, block_size).cpu()
    real = dequantize_experts(weight, scale, block_size).abs().cpu()
    gathered = (x if rows is None else x[rows]).double().abs().cpu()
    magnitude = torch.zeros_like(expected)
    for e in range(weight.shape[0]):
        a, b = offsets[e], offsets[e + 1]
        magnitude[a:b] = gathered[a:b] @ real[e].T  # sum_k |x| |W|
    k = weight.shape[2]
    bound = expected.abs() * OUTPUT_ULP[out.dtype] + magnitude * (k + k // 16 + 4) * 2.0**-23
    error = (out.double().cpu() - expected).abs()
    assert bool((error <= bound + 1e-12).all()), (error - bound).max()


# (tokens, experts, top_k, n, k, scales): 3 tokens x top-2 of 8 leave experts without rows;
# N = 40 and K = 72 / 80 are off every tile and cut the last scale blocks.
CASES = [
    (3, 8, 2, 40, 80, (32, 32)),
    (20, 4, 2, 40, 72, (24, 48)),  # ragged: rows span row blocks, K steps of 16
    (5, 4, 2, 40, 80, "channel"),
    (5, 4, 2, 40, 64, "tensor"),
]


@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_autotuned_matches_float64(case, dtype) -> None:
    *shape, block = case
    x, weight, scale, rows = _problem(*shape, block, dtype, seed=shape[0])
    rows_dev = rows.token.to(x.device)
    out = fp8_moe_grouped_gemm(x, rows_dev, weight, scale, rows.offsets, _block_size(block))
    assert out.shape == (rows.offsets[-1], shape[3]) and out.dtype == dtype
    _check(out, x, rows_dev, weight, scale, rows.offsets, block)


@pytest.mark.parametrize("block", [(32, 32), "channel"], ids=str)
def test_one_row_without_gather_and_empty_experts(block) -> None:
    """One output row (a decode step of one token, top-1), rows not gathered, every other
    expert empty; and a step with no rows at all."""
    x, weight, scale, _ = _problem(1, 4, 1, 40, 80, block, torch.float32)
    offsets = [0, 0, 0, 1, 1]  # expert 2's one row
    out = fp8_moe_grouped_gemm(x, None, weight, scale, offsets, _block_size(block))
    _check(out, x, None, weight, scale, offsets, block)
    empty = fp8_moe_grouped_gemm(x[:0], None, weight, scale, [0] * 5, _block_size(block))
    assert empty.shape == (0, 40)


def test_an_explicit_narrow_config_and_wide_tiles() -> None:
    """A config other than the autotuner's first (K steps of 32), and 40 rows for one expert
    (64-row tiles)."""
    x, weight, scale, _ = _problem(40, 2, 1, 40, 96, (32, 32), torch.float32, seed=3)
    offsets = [0, 40, 40]
    assert moe_row_bucket(offsets) == 64
    config = BlockGemmConfig(32, 32, 4, 2)
    assert config in GPU_CONFIGS
    out = fp8_moe_grouped_gemm(x, None, weight, scale, offsets, (32, 32), config=config)
    _check(out, x, None, weight, scale, offsets, (32, 32))


def test_the_scale_multiplies_only_its_block() -> None:
    """Doubling one expert's one block scale changes exactly that block's part."""
    x, weight, scale, _ = _problem(4, 2, 1, 40, 64, (32, 32), torch.float32, seed=5)
    offsets = [0, 2, 4]
    base = fp8_moe_grouped_gemm(x, None, weight, scale, offsets, (32, 32)).double()
    doubled = scale.clone()
    doubled[1, 1, 0] *= 2
    delta = fp8_moe_grouped_gemm(x, None, weight, doubled, offsets, (32, 32)).double() - base
    part = x[2:4, :32].double() @ (weight[1, 32:40, :32].double() * float(scale[1, 1, 0])).T
    expected = torch.zeros_like(delta)
    expected[2:4, 32:40] = part
    torch.testing.assert_close(delta, expected, atol=1e-5, rtol=1e-4)


def test_row_buckets() -> None:
    assert [moe_row_bucket(o) for o in ([0, 1, 1], [0, 17, 20], [0, 0, 300], [0])] == [
        16, 32, 64, 16,
    ]  # fmt: skip


def test_bad_operands_are_named() -> None:
    x, weight, scale, _ = _problem(2, 2, 1, 40, 64, (32, 32), torch.float32)
    offsets = [0, 1, 2]
    with pytest.raises(ValueError, match="weight must have dtype"):
        fp8_moe_grouped_gemm(x, None, weight.float(), scale, offsets, (32, 32))
    with pytest.raises(ValueError, match=r"weight_scale must be the block grids \[2, 2, 2\]"):
        fp8_moe_grouped_gemm(x, None, weight, scale[:, :1].contiguous(), offsets, (32, 32))
    with pytest.raises(ValueError, match=r"weight_scale must be per channel \[2, 40\]"):
        fp8_moe_grouped_gemm(x, None, weight, scale, offsets)
    with pytest.raises(ValueError, match="block_size must be"):
        fp8_moe_grouped_gemm(x, None, weight, scale, offsets, (32, 40))
    with pytest.raises(ValueError, match="offsets must be 3 ascending"):
        fp8_moe_grouped_gemm(x, None, weight, scale, [0, 2, 1], (32, 32))
    with pytest.raises(ValueError, match="does not fit"):
        fp8_moe_grouped_gemm(
            x, None, weight, scale, offsets, (32, 32), config=BlockGemmConfig(64, 64)
        )


def test_the_benchmark_quantizes_each_expert_per_block() -> None:
    """benchmarks/gpu/fp8_moe.py's setup (its run needs a GPU): every expert's own block
    scales, the FP8 stacks standing for the float ones within E4M3's rounding."""
    from benchmarks.gpu.fp8_moe import BLOCK, MoEShape, make_experts

    stacks = make_experts(MoEShape(2, 1, 160, 128), torch.device("cpu"), torch.float32)
    assert stacks["w13_q"].shape == (2, 256, 160) and stacks["w13_s"].shape == (2, 2, 2)
    assert stacks["w2_s"].shape == (2, 2, 1)
    for name in ("w13", "w2"):
        real = dequantize_experts(stacks[f"{name}_q"], stacks[f"{name}_s"], BLOCK).float()
        torch.testing.assert_close(real, stacks[name], rtol=2.0**-4, atol=1e-5)
