"""Projections filled from INT4 checkpoint modules as the checkpoint streams by.

`Int4Installer` maps a checkpoint module name to the `Linear` (and shard) it fills through
the model's `packed_modules_mapping`, collects a fused layer's shards (q|k|v, gate|up) in any
order, and once all are in gives the layer the method `make_method(parts)` builds: the Triton
`Int4LinearMethod` on CUDA (engine/layers/int4_linear.py), native Q4_0 blocks on the CPU
(engine/loader/int4_native.py). `prepare` empties the layers' float weights while the model
is still on meta, so they never get storage and the generic loader skips them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.loader.int4_packing import Int4Weight


class Int4Installer:
    """Checkpoint module name -> the `Linear` (and shard) it fills; collects a layer's
    shards and installs its method once all are in. Names that are not a
    projection `Linear` (stacked experts) are not taken: the loader dequantizes them."""

    def __init__(
        self,
        model: nn.Module,
        packed: Mapping[str, tuple[str, ...]],
        device: torch.device,
        make_method: Callable[[str, list[Int4Weight]], Any],
    ) -> None:
        self.device = device
        self.make_method = make_method
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
        shards[shard] = weight.to(self.device)  # the checkpoint's tensors are read on the CPU
        if len(shards) == num_shards:
            del self.shards[name]
            parts = [shards[i] for i in range(num_shards)]
            self.layers[name].quant_method = self.make_method(name, parts)
            self.num_installed += 1
        return True

    def check_complete(self) -> None:
        if self.shards:
            missing = sorted(self.shards)[:4]
            raise ValueError(f"INT4 layers missing some of their shards: {', '.join(missing)}.")
