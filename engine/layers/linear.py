"""Linear layers whose fp32 CPU GEMMs run on the method measured fastest for them.

A plain fp32 `F.linear` on CPU calls MKL's sgemm, which re-packs the whole weight matrix
into its blocked kernel layout on every call; for the skinny activations of a decode step
that repacking is a large share of the call, while at one row a GEMV beats any GEMM. So
`pack_linear_weights` gives each fp32 CPU `Linear` a `LinearPlan` at load time: per
row-count bucket, one of MKL packed GEMM, oneDNN, `F.linear` or our native GEMV, chosen by
a start-up measurement cached per CPU and torch build (engine/layers/linear_select.py).
Only the weight copies a chosen method needs are made (at most one per layer).

`packed_weight` is the MKL-packed copy where the plan keeps one (the untied LM head's
logits use it through `linear`). The packed layout does not depend on the activation's row
count (linear_select checks every method against `F.linear` on the real weight).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear_select import LinearPlan, make_plan, select_methods

logger = logging.getLogger(__name__)


def packing_available() -> bool:
    """Whether this torch build has MKL's packed fp32 GEMM ops."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def linear(
    x: torch.Tensor,  # [..., in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,  # MKL-packed `weight`, or None
) -> torch.Tensor:  # [..., out_features]
    """`F.linear`, on the packed weight when there is one (also at one row: batch-1 decode
    measured ≈4 % faster packed than through MKL's GEMV)."""
    if packed is None or x.dim() != 2 or x.shape[0] == 0:
        return F.linear(x, weight, bias)
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])


class Linear(nn.Linear):
    """`nn.Linear` with an optional MKL-packed copy of its weight (see the module doc).

    `output_sizes` names the row blocks of a fused projection (q | k | v, gate | up), in
    checkpoint order: the generic loader fills shard i at rows sum(output_sizes[:i]).
    """

    packed_weight: torch.Tensor | None = None
    # Set for fp32 CPU weights by `pack_linear_weights`: the method per row bucket.
    plan: LinearPlan | None = None
    # Set for quantized weights (engine/layers/quantization.py): computes the layer instead.
    quant_method: Any = None
    # True where code outside `forward` reads `weight` as a float matrix (MLA's kv_b_proj):
    # a checkpoint's quantized weight is then dequantized at load, never kept quantized.
    float_weight_only: bool = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        output_sizes: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        if output_sizes is not None and sum(output_sizes) != out_features:
            raise ValueError(f"output_sizes {output_sizes} do not add up to {out_features}.")
        self.output_sizes = output_sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(x, self.bias)
        if self.plan is not None and x.dim() == 2 and x.shape[0] > 0:
            return self.plan(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias, self.packed_weight)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The MKL-packed copy of an fp32 CPU weight [out_features, in_features]."""
    # The batch-size hint does not change the packed layout (see the module doc).
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach().contiguous(), 64)


def can_pack(weight: torch.Tensor) -> bool:
    """An fp32 or bf16 CPU matrix: what the measured methods run on."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and weight.dim() == 2
        and weight.numel() > 0
    )


def pack_linear_weights(model: nn.Module) -> int:
    """Gives every fp32 or bf16 CPU `Linear` of `model` its measured `LinearPlan` (and the
    weight copy it needs); returns how many layers got one. Does nothing off CPU or for
    other dtypes (quantized layers have no weight left)."""
    layers = [
        m
        for m in model.modules()
        if isinstance(m, Linear) and m.quant_method is None and can_pack(m.weight)
    ]
    for dtype in {layer.weight.dtype for layer in layers}:
        group = [layer for layer in layers if layer.weight.dtype == dtype]
        methods = select_methods([layer.weight for layer in group])
        for layer in group:
            layer.plan = make_plan(layer.weight, methods[tuple(layer.weight.shape)])
            layer.packed_weight = layer.plan.prepared.get("mkl_packed")
    return len(layers)
