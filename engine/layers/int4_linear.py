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

`Int4Installer` gives each projection `Linear` its method as the checkpoint streams by
(engine/loader/int4_weights.py) and empties its float weight before any storage exists, so
no bf16 copy of a quantized projection is ever made.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.loader.int4_packing import Int4Weight
from kernels.int4_gemm import int4_dequantize, int4_gemm

# Rows up to which the in-kernel dequantization beats dequantize-then-GEMM. Not measured
# yet: waits for a GPU run of benchmarks/gpu/int4_linear.py.
INT4_GEMM_MAX_ROWS = 64


class Int4LinearMethod:
    """x @ W.T + b over INT4 parts (Triton kernels: CUDA, or the interpreter in tests)."""

    def __init__(self, parts: list[Int4Weight], max_gemm_rows: int | None = None) -> None:
        self.parts = parts
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


class Int4Installer:
    """Checkpoint module name -> the `Linear` (and shard) it fills; collects a layer's
    shards and installs its `Int4LinearMethod` once all are in. Names that are not a
    projection `Linear` (stacked experts) are not taken: the loader dequantizes them."""

    def __init__(
        self, model: nn.Module, packed: Mapping[str, tuple[str, ...]], device: torch.device
    ) -> None:
        self.device = device
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
        self.packed = packed
        self.shards: dict[str, dict[int, Int4Weight]] = {}
        self.num_installed = 0

    def target(self, prefix: str) -> tuple[str, int, int] | None:
        """(layer name, shard index, number of shards) a checkpoint module fills, or None."""
        head, _, leaf = prefix.rpartition(".")
        for fused, members in self.packed.items():
            name = f"{head}.{fused}" if head else fused
            if leaf in members and name in self.layers:
                return name, members.index(leaf), len(members)
        return (prefix, 0, 1) if prefix in self.layers else None

    def prepare(self, quantized_prefixes: Iterable[str]) -> None:
        """Empties the weight of every layer the checkpoint stores quantized (call on the
        meta-built model, before it gets storage)."""
        for prefix in quantized_prefixes:
            target = self.target(prefix)
            if target is not None:
                layer = self.layers[target[0]]
                layer.weight = nn.Parameter(layer.weight.new_empty(0), requires_grad=False)

    def __call__(self, prefix: str, weight: Int4Weight) -> bool:
        """Takes one checkpoint module's INT4 weight; False when it fills no `Linear`."""
        target = self.target(prefix)
        if target is None or self.layers[target[0]].weight.numel() != 0:
            return False
        name, shard, num_shards = target
        shards = self.shards.setdefault(name, {})
        shards[shard] = weight.to(self.device)
        if len(shards) == num_shards:
            del self.shards[name]
            parts = [shards[i] for i in range(num_shards)]
            self.layers[name].quant_method = Int4LinearMethod(_fused(parts))
            self.num_installed += 1
        return True

    def check_complete(self) -> None:
        if self.shards:
            missing = sorted(self.shards)[:4]
            raise ValueError(f"INT4 layers missing some of their shards: {', '.join(missing)}.")


def _fused(parts: list[Int4Weight]) -> list[Int4Weight]:
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
