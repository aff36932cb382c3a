"""Linear layers on the batch-invariant Triton matmul (kernels/batch_invariant_matmul.py):
the `triton` backend's half of `make_batch_invariant` (engine/layers/batch_invariant/).

On a GPU a plain model's linears are `F.linear`, i.e. cuBLAS, which picks its algorithm,
tiling and split-K by the row count; here every fp32/fp16/bf16 `Linear` and the LM head get a
`TritonInvariantPlan` (the layer's `plan`, which its forward calls) over the one kernel whose
tiles are a function of the weight's shape and dtype only. Quantized layers (FP8, INT4, GGUF)
run their own batch-variant kernels and are refused, as are mixture-of-experts layers.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import Linear

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class TritonInvariantPlan:
    """A `Linear.plan` (x, weight, bias) -> x @ weight.T + bias on the invariant matmul."""

    def __init__(self) -> None:
        from kernels.batch_invariant_matmul import invariant_matmul  # triton: GPU images only

        self._matmul = invariant_matmul

    def __call__(
        self,
        x: torch.Tensor,  # [rows, in_features]
        weight: torch.Tensor,  # [out_features, in_features]
        bias: torch.Tensor | None,
    ) -> torch.Tensor:  # [rows, out_features]
        return self._matmul(x.contiguous(), weight, bias)


def _check_float(weight: torch.Tensor, what: str) -> None:
    if weight.dtype not in FLOAT_DTYPES or weight.dim() != 2 or weight.stride(-1) != 1:
        raise NotImplementedError(
            f"batch_invariant: {what} is {weight.dtype} {tuple(weight.shape)}; the Triton "
            "batch-invariant matmul takes contiguous float32/float16/bfloat16 weights."
        )


def make_triton_batch_invariant(model: nn.Module) -> int:
    """Puts every linear layer and the LM head of `model` (built and loaded) on the
    invariant Triton matmul; returns how many matrices it changed."""
    if any(hasattr(m, "expert_param_shards") for m in model.modules()):
        raise NotImplementedError("batch_invariant is not supported for mixture-of-experts models.")
    if getattr(model, "quantized_logits", None) is not None:
        raise NotImplementedError("batch_invariant on the triton backend: a quantized LM head.")
    changed = 0
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        if module.quant_method is not None:
            raise NotImplementedError(
                f"batch_invariant on the triton backend: {type(module.quant_method).__name__} "
                "weights have no batch-invariant kernel (float weights only)."
            )
        _check_float(module.weight, "a linear weight")
        module.plan = TritonInvariantPlan()
        module.packed_weight = None  # `linear()` would use it for non-2-D inputs
        changed += 1
    if hasattr(model, "_logits_plan") and model.model.is_last_stage:
        weight = model._logits_weight
        _check_float(weight, "the LM head")
        model._logits_plan = TritonInvariantPlan()
        changed += 1
    if hasattr(model, "greedy_screen"):
        model.greedy_screen = None
    return changed
