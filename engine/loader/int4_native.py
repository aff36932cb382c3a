"""Symmetric INT4 (GPTQ `sym`, compressed-tensors W4A16) weights repacked exactly into the
native CPU kernels' GGUF Q4_0 blocks, so they stay 4-bit on the CPU (engine/native/quant.py).

A Q4_0 block holds 32 consecutive input values of one output row: an fp16 scale d and 16
bytes, byte j = q[j] | q[j + 16] << 4, value = d (q - 8). A symmetric GPTQ weight is
s (q - 8) with one fp16 s per group of 32, 64 or 128 inputs (or the whole row), so each
32-value block takes its group's s as d and the same codes: bit for bit the checkpoint's
numbers (bf16 scales too, where each converts to fp16 exactly: checked per weight).
Zero-point weights (AWQ, GPTQ `sym=false`) are s (q - z): as Q4_1 (d q + m) they
would need m = -z s in fp16, which rounds, so they are dequantized at load instead; so are
act-order weights (the kernels cannot gather their input columns).
"""

from __future__ import annotations

import torch

from engine.config.weights.int4_checkpoint import Int4Scheme
from engine.loader.int4_packing import SYMMETRIC_ZERO, Int4Weight, unpack_rows
from engine.native.quant import QType, QuantizedWeight

Q4_0_VALUES = 32


def fits_q4_0(scheme: Int4Scheme) -> bool:
    """Whether every weight of the scheme repacks exactly (symmetric, no act-order)."""
    return scheme.fits_q4_0


def int4_to_q4_0(name: str, weight: Int4Weight) -> QuantizedWeight:
    """The [out, in] Q4_0 weight with exactly `weight`'s values; ValueError where it cannot."""
    k, n = weight.in_features, weight.out_features
    if weight.perm is not None:
        raise ValueError(f"{name}: act-order rows (a g_idx out of order) do not fit Q4_0 blocks.")
    if k % Q4_0_VALUES or weight.group_size % Q4_0_VALUES:
        raise ValueError(
            f"{name}: {k} inputs in groups of {weight.group_size} do not split into Q4_0 "
            f"blocks of {Q4_0_VALUES}."
        )
    if not torch.equal(weight.scales.to(torch.float16).to(weight.scales.dtype), weight.scales):
        # bf16 scales (compressed-tensors) convert exactly within fp16's range, which
        # quantization scales rarely leave
        raise ValueError(
            f"{name}: {str(weight.scales.dtype).removeprefix('torch.')} scales that fp16 "
            "cannot hold exactly do not fit Q4_0 blocks; pass dtype='bfloat16' to "
            "dequantize them at load."
        )
    if not bool((weight.zeros == SYMMETRIC_ZERO).all()):
        raise ValueError(f"{name}: zero points other than {SYMMETRIC_ZERO} do not fit Q4_0.")
    blocks = k // Q4_0_VALUES
    codes = unpack_rows(weight.qweight).T.reshape(n, blocks, Q4_0_VALUES)  # [N, B, 32]
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # [N, B, 16] uint8
    group_of_block = torch.arange(blocks) * Q4_0_VALUES // weight.group_size  # [B]
    d = weight.scales.to(torch.float16).T[:, group_of_block].contiguous()  # [N, B] fp16
    data = torch.cat([d.view(torch.uint8).reshape(n, blocks, 2), packed], dim=-1)
    return QuantizedWeight(data.reshape(n, blocks * 18).contiguous(), QType.Q4_0, k)
