"""MXFP4 (OCP microscaling FP4) weights dequantized to floats, as GPT-OSS's released
checkpoints store their expert projections.

Each row of a matrix is cut into groups of 32 values. A group is 16 bytes of E2M1 codes
(two per byte, the low nibble first) and one E8M0 scale byte, a power of two biased by 127::

    *_blocks  uint8 [..., rows, groups, 16]    *_scales  uint8 [..., rows, groups]
    value[..., r, 32 g + 2 j]     = FP4[blocks[..., r, g, j] & 0xF] * 2 ** (scales[..., r, g] - 127)
    value[..., r, 32 g + 2 j + 1] = FP4[blocks[..., r, g, j] >> 4]  * 2 ** (scales[..., r, g] - 127)

The result is [..., rows, groups * 32] in the checkpoint's [out, in] orientation. The engine
keeps the dequantized floats (keeping the blocks packed behind the linear-layer interface is
a later step); one leading slice (an expert) at a time bounds the temporary memory.
"""

from __future__ import annotations

import torch

# E2M1: sign bit, two exponent bits, one mantissa bit; codes 0-7 positive, 8-15 negative.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES += tuple(-v for v in FP4_VALUES)
GROUP_SIZE = 32
SCALE_BIAS = 127


def dequantize_mxfp4(
    blocks: torch.Tensor,  # uint8 [..., rows, groups, 16]
    scales: torch.Tensor,  # uint8 [..., rows, groups]
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [..., rows, groups * 32] of `dtype`
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}/{scales.dtype}."
        )
    if blocks.dim() < 2 or blocks.shape[-1] != GROUP_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: need "
            f"blocks [..., groups, {GROUP_SIZE // 2}] and scales [..., groups]."
        )
    *lead, groups, _ = blocks.shape
    out = torch.empty(*lead, groups * GROUP_SIZE, dtype=dtype)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    flat_blocks = blocks.reshape(-1, *blocks.shape[-2:]) if lead else blocks[None]
    flat_scales = scales.reshape(-1, groups) if lead else scales[None]
    flat_out = out.view(-1, groups * GROUP_SIZE) if lead else out[None]
    # One slice along the first leading dim (an expert's matrix) at a time.
    step = max(1, flat_blocks.shape[0] // (lead[0] if lead else 1))
    for start in range(0, flat_blocks.shape[0], step):
        b = flat_blocks[start : start + step].long()  # [n, groups, 16]
        codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)  # [n, groups, 32]
        values = lut[codes]  # [n, groups, 32] fp32
        exponents = flat_scales[start : start + step].to(torch.int32) - SCALE_BIAS  # [n, groups]
        values = torch.ldexp(values, exponents[..., None])
        flat_out[start : start + step] = values.flatten(-2).to(dtype)
    return out
