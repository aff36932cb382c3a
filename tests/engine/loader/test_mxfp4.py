"""MXFP4 dequantization (engine/loader/mxfp4.py) against two independent references:
transformers' own GPT-OSS helper (`convert_moe_packed_tensors`, which also transposes to
its [in, out] layout) over random blocks and every scale a checkpoint can hold, and a few
values worked out by hand from the format's definition."""

from __future__ import annotations

import pytest
import torch

from engine.loader.mxfp4 import dequantize_mxfp4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_dequantization(dtype) -> None:
    from transformers.integrations import mxfp4

    gen = torch.Generator().manual_seed(0)
    experts, rows, groups = 3, 10, 4  # [E, out, in = groups * 32]
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (experts, rows, groups), generator=gen, dtype=torch.uint8)
    scales[0, 0] = torch.tensor([0, 1, 254, 255], dtype=torch.uint8)[:groups]  # the extremes
    ours = dequantize_mxfp4(blocks, scales, dtype)
    assert ours.shape == (experts, rows, groups * 32) and ours.dtype == dtype
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    torch.testing.assert_close(ours, theirs.transpose(1, 2), atol=0, rtol=0)


def test_hand_worked_values() -> None:
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x72  # low nibble 2 (+1.0) first, high nibble 7 (+6.0) second
    blocks[0, 0, 1] = 0xF9  # 9 (-0.5), then 15 (-6.0)
    scales = torch.tensor([[129]], dtype=torch.uint8)  # 2 ** (129 - 127) = 4
    out = dequantize_mxfp4(blocks, scales)
    assert out.shape == (1, 32)
    assert out[0, :4].tolist() == [4.0, 24.0, -2.0, -24.0]
    assert out[0, 4:].abs().sum() == 0


def test_misshapen_inputs_are_refused() -> None:
    blocks = torch.zeros(2, 3, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scales"):
        dequantize_mxfp4(blocks, torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.int(), torch.zeros(2, 3, dtype=torch.uint8))
