"""Projections kept in INT4 (AWQ / GPTQ checkpoints) behind the linear-layer interface.

`Int4LinearMethod` is a `LinearMethod` (engine/layers/quantization.py) over one or more
`Int4Weight` parts (engine/loader/int4_packing.py) laid side by side along the output (a
fused q|k|v or gate|up whose checkpoint shards arrive separately)::

    rows <= max_kernel_rows   int4_gemm(x, part)                 weights read at 4 bits
    more rows                 x @ int4_dequantize(part)          a library GEMM

Decode steps are memory-bound (the kernel reads a quarter of bf16's bytes); prefill chunks
are compute-bound, where cuBLAS on the dequantized matrix wins. Where the two cross is
measured per shape on the GPU at load (engine/layers/crossover.py: this is a `TwoRoutes`
method); `INT4_GEMM_MAX_ROWS` is the value until then, with the measurement off, and on the
CPU (vLLM's AWQ path switches at 256 tokens). Act-order parts gather their input columns
first.

engine/layers/int4_installer.py gives each projection `Linear` its method as the checkpoint
streams by, so no bf16 copy of a quantized projection is ever made.
"""

from __future__ import annotations

import torch

from engine.loader.int4_packing import Int4Weight
from kernels.int4_gemm import int4_dequantize, int4_gemm

# Rows up to which the in-kernel dequantization runs when the crossover is not measured
# (engine/layers/crossover.py measures it per shape on CUDA).
INT4_GEMM_MAX_ROWS = 64


class Int4LinearMethod:
    """x @ W.T + b over INT4 parts (Triton kernels: CUDA, or the interpreter in tests)."""

    def __init__(self, parts: list[Int4Weight], max_kernel_rows: int | None = None) -> None:
        self.parts = fused_parts(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)
        self.max_kernel_rows = INT4_GEMM_MAX_ROWS if max_kernel_rows is None else max_kernel_rows

    def crossover_key(self) -> str:
        shapes = "+".join(f"{p.out_features}" for p in self.parts)
        group = self.parts[0].group_size
        order = " act-order" if any(p.perm is not None for p in self.parts) else ""
        return f"int4 {shapes}x{self.in_features} g{group}{order}"

    def _part(self, x: torch.Tensor, part: Int4Weight, kernel: bool) -> torch.Tensor:
        # [M, K] -> [M, N]
        if part.perm is not None:
            x = x[:, part.perm]  # act-order: the rows of W are sorted by group
        if kernel:
            return int4_gemm(x, part.qweight, part.scales, part.zeros, part.group_size)
        weight = int4_dequantize(part.qweight, part.scales, part.zeros, part.group_size, x.dtype)
        return x @ weight  # [M, K] @ [K, N]

    def route(self, x: torch.Tensor, kernel: bool) -> torch.Tensor:  # [M, K] -> [M, N]
        outs = [self._part(x, part, kernel) for part in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def apply(
        self,
        x: torch.Tensor,  # [..., in_features]
        bias: torch.Tensor | None,  # [out_features]
    ) -> torch.Tensor:  # [..., out_features]
        x2 = x.reshape(-1, self.in_features).contiguous()
        out = self.route(x2, kernel=x2.shape[0] <= self.max_kernel_rows)
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
