"""Projections kept in INT4 (AWQ / GPTQ checkpoints) behind the linear-layer interface.

`Int4LinearMethod` is a `LinearMethod` (engine/layers/quantization.py) over one or more
`Int4Weight` parts (engine/loader/int4_packing.py) laid side by side along the output (a
fused q|k|v or gate|up whose checkpoint shards arrive separately)::

    rows <= INT4_GEMM_MAX_ROWS   int4_gemm(x, part)                 weights read at 4 bits
    more rows                    x @ int4_dequantize(part)          a library GEMM

Decode steps are memory-bound (the kernel reads a quarter of bf16's bytes); prefill chunks
are compute-bound, where cuBLAS on the dequantized matrix wins. `INT4_GEMM_MAX_ROWS` is a
placeholder (vLLM's AWQ path switches at 256 tokens) until benchmarks/gpu/int4_linear.py
measures the crossover on an H100/H200. Act-order parts gather their input columns first.

engine/layers/int4_installer.py gives each projection `Linear` its method as the checkpoint
streams by, so no bf16 copy of a quantized projection is ever made.
"""

from __future__ import annotations

import torch

from engine.loader.int4_packing import Int4Weight
from kernels.int4_gemm import int4_dequantize, int4_gemm

# Rows up to which the in-kernel dequantization beats dequantize-then-GEMM. Not measured
# yet: waits for a GPU run of benchmarks/gpu/int4_linear.py.
INT4_GEMM_MAX_ROWS = 64


class Int4LinearMethod:
    """x @ W.T + b over INT4 parts (Triton kernels: CUDA, or the interpreter in tests)."""

    def __init__(self, parts: list[Int4Weight], max_gemm_rows: int | None = None) -> None:
        self.parts = fused_parts(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)
        self.max_gemm_rows = INT4_GEMM_MAX_ROWS if max_gemm_rows is None else max_gemm_rows

    def _part(self, x: torch.Tensor, part: Int4Weight) -> torch.Tensor:  # [M, K] -> [M, N]
        if part.perm is not None:
            x = x[:, part.perm]  # act-order: the rows of W are sorted by group
        if x.shape[0] <= self.max_gemm_rows:
            return int4_gemm(x, part.qweight, part.scales, part.zeros, part.group_size)
        weight = int4_dequantize(part.qweight, part.scales, part.zeros, part.group_size, x.dtype)
        return x @ weight  # [M, K] @ [K, N]

    def apply(
        self,
        x: torch.Tensor,  # [..., in_features]
        bias: torch.Tensor | None,  # [out_features]
    ) -> torch.Tensor:  # [..., out_features]
        x2 = x.reshape(-1, self.in_features).contiguous()
        outs = [self._part(x2, part) for part in self.parts]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        tensors = [t for p in self.parts for t in (p.qweight, p.scales, p.zeros)]
        return sum(t.numel() * t.element_size() for t in tensors)


def fused_parts(parts: list[Int4Weight]) -> list[Int4Weight]:
    """Shards sharing group size and input order become one part (one launch)."""
    first = parts[0]
    if len(parts) == 1 or any(
        p.perm is not None or p.group_size != first.group_size for p in parts
    ):
        return parts
    return [
        Int4Weight(
            torch.cat([p.qweight for p in parts], dim=1).contiguous(),
            torch.cat([p.scales for p in parts], dim=1).contiguous(),
            torch.cat([p.zeros.to(first.scales.dtype) for p in parts], dim=1).contiguous(),
            first.group_size,
            None,
        )
    ]
