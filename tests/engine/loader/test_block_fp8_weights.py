"""Block-scaled FP8 tensors in the checkpoint stream (engine/loader/fp8_weights.py): the
dequantization exact against float64 for whole and ragged edge blocks, square or not, fp32
and power-of-two (ue8m0) scales; both formats' tensor names paired in any order; what is
refused; what passes through."""

from __future__ import annotations

import pytest
import torch

from engine.config.weights.fp8_checkpoint import Fp8Scheme
from engine.loader.fp8_weights import Fp8Checkpoint, dequantize_block_fp8
from tests.engine.block_fp8_checkpoints import dequantize_blocks_float64, quantize_blocks

FP8 = torch.float8_e4m3fn


def _weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes, so a scale applied to the wrong block shows
    magnitudes = torch.logspace(-3, 1, rows)[torch.randperm(rows, generator=generator)]
    return torch.randn(rows, cols, generator=generator) * magnitudes[:, None]


# (N, K, block): whole blocks, ragged rows, ragged columns, both, a block larger than the
# matrix, non-square blocks, DeepSeek-V3's kv_a_proj_with_mqa (576 = 4.5 blocks of 128)
SHAPES = [
    (256, 128, (128, 128)),
    (160, 128, (128, 128)),
    (128, 200, (128, 128)),
    (161, 289, (128, 128)),
    (20, 30, (128, 128)),
    (97, 75, (32, 48)),
    (576, 256, (128, 128)),
]


@pytest.mark.parametrize(("n", "k", "block"), SHAPES)
def test_dequantization_is_exact_against_float64(n, k, block) -> None:
    q, scale = quantize_blocks(_weight(n, k, n + k), block)
    expected = dequantize_blocks_float64(q, scale, block)  # [N, K] float64
    got = dequantize_block_fp8(q, scale, block, torch.float32)
    assert got.shape == (n, k) and got.is_contiguous()
    # one fp32 multiply of an E4M3 value by an fp32 scale is the float64 product rounded once
    assert torch.equal(got, expected.float())
    bf16 = dequantize_block_fp8(q, scale, block, torch.bfloat16)
    torch.testing.assert_close(bf16, expected.to(torch.bfloat16), rtol=2**-8, atol=0)


@pytest.mark.parametrize("storage", ["float32", "e8m0", "uint8"])
def test_power_of_two_scales_are_exact_in_bf16(storage) -> None:
    """ue8m0 scales (DeepSeek-V3.1's scale_fmt): powers of two, stored as fp32, as
    float8_e8m0fnu, or as its bytes (2^(byte - 127)); any product is exact in bf16."""
    q = (torch.randn(70, 40, generator=torch.Generator().manual_seed(0)) * 50).to(FP8)
    exponents = torch.tensor([[-9, 3], [0, -2], [5, -12], [1, 1], [-1, 7]])
    scale = torch.exp2(exponents.float())  # [ceil(70/16), ceil(40/32)]
    stored = {
        "float32": scale,
        "e8m0": scale.to(torch.float8_e8m0fnu),
        "uint8": (exponents + 127).to(torch.uint8),
    }[storage]
    got = dequantize_block_fp8(q, stored, (16, 32), torch.bfloat16)
    expected = dequantize_blocks_float64(q, scale, (16, 32))
    assert torch.equal(got, expected.to(torch.bfloat16))


def test_a_scale_grid_of_the_wrong_shape_is_refused_naming_the_module() -> None:
    checkpoint = Fp8Checkpoint(Fp8Scheme("block", "dynamic", block_size=(128, 128)), torch.float32)
    stream = [
        ("model.layers.0.mlp.down_proj.weight", torch.zeros(160, 288, dtype=FP8)),
        ("model.layers.0.mlp.down_proj.weight_scale_inv", torch.ones(1, 2)),
    ]
    named = r"model\.layers\.0\.mlp\.down_proj: .*\[2, 3\], got \[1, 2\]"
    with pytest.raises(ValueError, match=named):
        list(checkpoint.weights(iter(stream)))


def test_both_formats_names_in_any_order() -> None:
    """transformers' weight_scale_inv (and static activation_scale, dropped) and
    compressed-tensors' weight_scale; float tensors pass through; the scale may come first."""
    block = (32, 32)
    w1, w2 = _weight(40, 70, 1), _weight(33, 64, 2)
    (q1, s1), (q2, s2) = quantize_blocks(w1, block), quantize_blocks(w2, block)
    stream = [
        ("a.q_proj.weight_scale_inv", s1),
        ("a.q_proj.activation_scale", torch.tensor(0.5)),
        ("a.norm.weight", torch.ones(8)),
        ("a.gate.weight", torch.ones(4, 8)),  # a float Linear the config leaves unquantized
        ("a.o_proj.weight", q2),
        ("a.q_proj.weight", q1),
        ("a.o_proj.weight_scale", s2),
    ]
    checkpoint = Fp8Checkpoint(Fp8Scheme("block", "dynamic", block_size=block), torch.float32)
    out = dict(checkpoint.weights(iter(stream)))
    assert sorted(out) == ["a.gate.weight", "a.norm.weight", "a.o_proj.weight", "a.q_proj.weight"]
    assert torch.equal(out["a.q_proj.weight"], dequantize_blocks_float64(q1, s1, block).float())
    assert torch.equal(out["a.o_proj.weight"], dequantize_blocks_float64(q2, s2, block).float())
    # and the quantization round trip is within E4M3's rounding of the float weights
    err = (out["a.q_proj.weight"] - w1).abs()
    assert bool((err <= w1.abs() / 16 + s1.max() * 2**-9).all())


def test_an_fp8_tensor_that_is_not_a_weight_is_refused() -> None:
    """transformers 5's stacked expert tensors have no `.weight` and no scale to pair: taken
    as they are they would load unscaled E4M3 numbers."""
    checkpoint = Fp8Checkpoint(Fp8Scheme("block", "dynamic", block_size=(128, 128)), torch.float32)
    stream = [("model.layers.1.mlp.experts.gate_up_proj", torch.zeros(4, 8, 8, dtype=FP8))]
    with pytest.raises(ValueError, match=r"gate_up_proj.*not a module's weight"):
        list(checkpoint.weights(iter(stream)))


def test_skipped_layers_pass_through_untouched() -> None:
    """Layers the model never loads (DeepSeek's multi-token prediction layer) are neither
    dequantized nor paired: the loader skips them as they are."""
    scheme = Fp8Scheme("block", "dynamic", block_size=(128, 128))
    checkpoint = Fp8Checkpoint(scheme, torch.float32, skipped=("model.layers.2.",))
    q = torch.zeros(8, 8, dtype=FP8)
    stream = [("model.layers.2.eh_proj.weight", q)]  # its scale never comes
    assert list(checkpoint.weights(iter(stream))) == [("model.layers.2.eh_proj.weight", q)]
