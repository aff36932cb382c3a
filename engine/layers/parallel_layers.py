"""Tensor-parallel layers (Megatron's layout; engine/distributed/sharding.py says who holds
what). In a world of one each is exactly the plain layer it extends.

- Column-parallel: a plain `Linear` whose output rows are this rank's slice; it records
  `checkpoint_slices` (one `RowSlice` per shard of a fused projection) so the generic
  loader reads only those rows. No communication.
- `RowParallelLinear`: input columns split; each rank's partial product is summed over
  the TP group by one all-reduce. The bias is added once (by TP rank 0, before the sum).
  A partial hook sees the partial product before the sum (a LoRA update of this rank's
  columns is added there, as vLLM's row-parallel LoRA layer does).
- `VocabParallelEmbedding`: vocabulary rows split (padded to a multiple of the TP size);
  ids outside this rank's rows embed to zero, and the all-reduce fills them in. As the LM
  head (tied) its rows give this rank's slice of the logits, which
  `engine.distributed.communication.tp_gather_last_dim` joins on the sampling rank.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from engine.distributed.communication import tp_all_reduce
from engine.distributed.parallel_state import get_parallel_rank
from engine.distributed.sharding import RowSlice, vocab_partition
from engine.layers.linear import Linear


def column_parallel_linear(
    in_features: int,
    slices: tuple[RowSlice, ...],
    bias: bool,
) -> Linear:
    """A `Linear` holding rows `slices` of each shard (q | k | v, gate | up, or one)."""
    sizes = tuple(s.size for s in slices)
    layer = Linear(
        in_features, sum(sizes), bias=bias, output_sizes=sizes if len(sizes) > 1 else None
    )
    if any(s.size != s.full_size for s in slices):
        layer.checkpoint_slices = {"weight": (0, slices), "bias": (0, slices)}
    return layer


class RowParallelLinear(Linear):
    """x[:, this rank's columns] @ W[:, columns].T, summed over the TP group."""

    def __init__(self, full_in_features: int, out_features: int, bias: bool = True) -> None:
        ranks = get_parallel_rank()
        self.tp_size, self.tp_rank = ranks.tp_size, ranks.tp_rank
        in_features = full_in_features // self.tp_size
        super().__init__(in_features, out_features, bias=bias)
        # An OrderedDict, as torch's own hook registries: RemovableHandle holds a weakref.
        self._partial_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        if self.tp_size > 1:  # the loader takes columns [start, start + in_features)
            columns = RowSlice(self.tp_rank * in_features, in_features, full_in_features)
            self.checkpoint_slices = {"weight": (1, (columns,))}

    def post_load(self) -> None:
        """The bias is added by one rank only, so the sum counts it once."""
        if self.tp_rank != 0 and self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def register_partial_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """`hook(module, (x,), partial)` runs on this rank's partial product, before the
        sum over the TP group, and may update it in place (a forward hook would see the
        sum)."""
        handle = RemovableHandle(self._partial_hooks)
        self._partial_hooks[handle.id] = hook
        return handle

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in/tp] -> [T, out]
        out = super().forward(x)
        for hook in self._partial_hooks.values():
            hook(self, (x,), out)
        return tp_all_reduce(out) if self.tp_size > 1 else out


class VocabParallelEmbedding(nn.Embedding):
    """`nn.Embedding` over this rank's vocabulary rows (all of them in a world of one)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        ranks = get_parallel_rank()
        self.tp_size = ranks.tp_size
        start, per_rank, num_real = vocab_partition(vocab_size, ranks.tp_rank, ranks.tp_size)
        super().__init__(per_rank, hidden_size)
        self.vocab_start, self.num_real_rows = start, num_real
        if self.tp_size > 1:
            rows = RowSlice(start, num_real, vocab_size)
            self.checkpoint_slices = {"weight": (0, (rows,))}

    def reset_parameters(self) -> None:
        """No random draw on the meta device, where the loader builds every model before its
        weights are read: `nn.init.normal_` on a meta tensor goes through torch's reference
        ops, whose first use imports torch._dynamo (and with it triton, where installed):
        about 90 MiB of peak RSS for nothing (docs/engine.md, "Memory")."""
        if not self.weight.is_meta:
            super().reset_parameters()

    def post_load(self) -> None:
        """Padding rows (past the vocabulary) hold zeros: their logits are dropped and no
        id looks them up, but uninitialised memory could hold NaNs."""
        if self.num_real_rows < self.weight.shape[0]:
            with torch.no_grad():
                self.weight[self.num_real_rows :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp_size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_real_rows)  # [T]
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(out)


def post_load(model: nn.Module) -> None:
    """Runs every parallel layer's fix-up after the weights are in."""
    for module in model.modules():
        if isinstance(module, RowParallelLinear | VocabParallelEmbedding):
            module.post_load()
