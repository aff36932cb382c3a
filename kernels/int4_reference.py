"""Pure-torch references for kernels/int4_gemm.py: the INT4 weight unpacked nibble by
nibble in plain loops, dequantized in fp32 (the layout is that module's doc)."""

from __future__ import annotations

import torch


def ref_int4_dequantize(
    qweight: torch.Tensor,  # int32 [K / 8, N]
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N]
    group_size: int,
) -> torch.Tensor:  # [K, N] fp32
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    out = torch.empty(k, n, dtype=torch.float32)
    packed = qweight.cpu().to(torch.int64) & 0xFFFFFFFF  # as unsigned 32-bit words
    for row in range(k):
        codes = (packed[row // 8] >> (4 * (row % 8))) & 0xF  # [N]
        group = row // group_size
        out[row] = (codes.float() - zeros[group].float().cpu()) * scales[group].float().cpu()
    return out.to(qweight.device)


def ref_int4_gemm(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:  # [M, N] fp32
    return x.float() @ ref_int4_dequantize(qweight, scales, zeros, group_size)
