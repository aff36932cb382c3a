"""Storage for a model built on the meta device: what `nn.Module.to_empty` does, without
its import of sympy.

`to_empty` calls `torch.empty_like(t, device=device)` on every parameter and buffer; for a
meta tensor that runs torch's Python reference (`torch._refs.empty_like`), whose stride
computation imports `torch.fx.experimental.symbolic_shapes` and with it sympy: 1-2 s of an
engine's start on a 2-core machine, for tensors whose strides are already known
(docs/benchmarks.md, "Engine start-up"). A dense tensor's `empty_like` has its strides, so
`torch.empty_strided` with them gives the same tensor; anything else still goes through
`empty_like`.
"""

from __future__ import annotations

import torch
from torch import nn


def _empty(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    if tensor.is_contiguous():  # dense, non-overlapping: empty_like keeps these strides
        return torch.empty_strided(
            tensor.size(), tensor.stride(), dtype=tensor.dtype, device=device
        )
    return torch.empty_like(tensor, device=device)


def to_empty(model: nn.Module, device: torch.device | str) -> nn.Module:
    """`model.to_empty(device=device)`: every parameter and buffer replaced by uninitialised
    storage on `device`, of the same shape, strides, dtype and `requires_grad`."""
    return model._apply(lambda tensor: _empty(tensor, device))
