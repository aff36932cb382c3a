"""Linear layers on the batch-invariant kernel (engine/native/batch_invariant.py).

A plain model's linears are batch-variant on the CPU twice over: the route is chosen per
row-count bucket (MKL packed GEMM, oneDNN, `F.linear`, our GEMV or GEMM:
engine/layers/linear_select.py; quant_select.py for quantized weights), and each of those
libraries tiles, splits and orders its sums by the row count too. `make_batch_invariant`
replaces every route of a built model with one kernel whose per-row result does not depend
on the row count:

- fp32 `Linear`s get an `InvariantPlan` (the layer's `plan`, which its forward calls),
- quantized ones (GGUF blocks, int8) an `InvariantLinearMethod` (the layer's
  `quant_method`), the same kernel over their stored blocks,
- the LM head (a plan, or a quantized method) likewise, and the greedy screen is dropped
  (its pre-pass and the logits it recomputes for the candidates go through the
  batch-variant kernels), so greedy tokens come from the same logits as logprobs do.

Mixture-of-experts layers group their rows by expert (the grouping depends on the batch):
they are refused, as are models without the native kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.native.batch_invariant import invariant_linear
from engine.native.quant import QuantizedWeight, fp32_weight


class InvariantPlan:
    """A `Linear.plan` (x, weight, bias) -> x @ weight.T + bias on the invariant kernel,
    reading the fp32 weight in place."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = fp32_weight(weight)  # shares the weight's memory

    def __call__(
        self,
        x: torch.Tensor,  # [rows, in_features]
        weight: torch.Tensor,  # [out_features, in_features], the one viewed at build
        bias: torch.Tensor | None,
    ) -> torch.Tensor:  # [rows, out_features]
        return invariant_linear(x, self.weight, bias)


class InvariantLinearMethod:
    """The `LinearMethod` of a quantized layer on the invariant kernel; several parts (a
    fused q|k|v stored in different block types) fill one output side by side."""

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        self.parts = parts
        self.out_features = sum(part.out_features for part in parts)

    def apply(
        self,
        x: torch.Tensor,  # [..., in_features]
        bias: torch.Tensor | None,  # [out_features]
    ) -> torch.Tensor:  # [..., out_features]
        if len(self.parts) == 1:
            return invariant_linear(x, self.parts[0], bias)
        out = torch.cat([invariant_linear(x, part) for part in self.parts], dim=-1)
        return out if bias is None else out + bias

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


def _invariant_method(method: Any) -> InvariantLinearMethod:
    parts = getattr(method, "parts", None)
    if not parts or not all(isinstance(part, QuantizedWeight) for part in parts):
        raise NotImplementedError(
            f"batch_invariant: no batch-invariant kernel for {type(method).__name__} weights."
        )
    return InvariantLinearMethod(list(parts))


def _check_fp32_cpu(weight: torch.Tensor, what: str) -> None:
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        raise NotImplementedError(
            f"batch_invariant: {what} is {weight.dtype} on {weight.device}; the CPU "
            "batch-invariant kernels take float32 weights (or GGUF / int8 blocks)."
        )


def make_batch_invariant(model: nn.Module, backend: str = "cpu") -> int:
    """Puts every linear layer and the LM head of `model` (built, loaded and planned) on
    the batch-invariant kernel of the attention `backend` ("cpu": the native one; "triton":
    the Triton matmul, triton_linear.py); returns how many matrices it changed."""
    if backend == "triton":
        from engine.layers.batch_invariant.triton_linear import make_triton_batch_invariant

        return make_triton_batch_invariant(model)
    if any(hasattr(m, "expert_param_shards") for m in model.modules()):
        raise NotImplementedError("batch_invariant is not supported for mixture-of-experts models.")
    changed = 0
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        if module.quant_method is not None:
            module.quant_method = _invariant_method(module.quant_method)
        else:
            _check_fp32_cpu(module.weight, "a linear weight")
            module.plan = InvariantPlan(module.weight)
            module.packed_weight = None  # `linear()` would use it for non-2-D inputs
        changed += 1
    if getattr(model, "quantized_logits", None) is not None:
        model.quantized_logits = _invariant_method(model.quantized_logits)
        changed += 1
    elif hasattr(model, "_logits_plan") and model.model.is_last_stage:
        weight = model._logits_weight
        _check_fp32_cpu(weight, "the LM head")
        model._logits_plan = InvariantPlan(weight)
        changed += 1
    if hasattr(model, "greedy_screen"):
        model.greedy_screen = None
    return changed
