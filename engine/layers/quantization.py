"""Weights kept quantized behind the linear-layer interface (EngineArgs `quantization`).

Each projection `Linear` gets a `LinearMethod` that computes the layer from the quantized
weight, and its fp32 `weight` is left empty. The model code is untouched: a `Linear` with a
`quant_method` calls it in `forward`.

- ``"gguf"``: the GGUF file's own blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) for every
  projection, and the embedding / LM head as the file stores them. They are read from the
  file into the model while it is still on meta (engine/loader/gguf_weights.py), so no
  fp32 copy of a projection is ever made, and sample rows are checked against the fp32
  weights transformers dequantized from the same file.
- ``"int8"``: per-output-channel symmetric int8 of each projection (weight-only), made from
  the checkpoint's weights while they load: `quantize_on_load` quantizes a projection as
  soon as all its shards are in and frees its fp32 copy, so at most one projection's fp32
  weight is resident beside the int8 ones; the embedding and LM head stay in the
  checkpoint's dtype, as in vLLM's weight-only methods.

Only a CPU method exists today (`CPUQuantizedLinearMethod`, native kernels); a GPU one (a
Triton dequant-GEMM) would be another `LinearMethod` picked by `_linear_method`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.layers.row_buckets import bucket_of
from engine.native.quant import QuantizedWeight, quant_linear, quantize_int8
from engine.native.quant_int8 import quant_linear_int8

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("gguf", "int8")


class LinearMethod(Protocol):
    """How a `Linear` with a non-default weight format computes x @ W.T + b."""

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class CPUQuantizedLinearMethod:
    """Native fp32-activation kernels on quantized weights; several parts (fused q|k|v
    stored in different block types) run one after the other into one output."""

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        self.parts = parts
        self.out_features = sum(part.out_features for part in parts)
        # Per part, the route per row bucket (engine/layers/quant_select.py), or None: fp32.
        self.routes: list[tuple[str, ...] | None] = [None] * len(parts)

    def set_routes(self, routes: list[tuple[str, ...] | None]) -> None:
        """Each part's route per row bucket ("fp32" or "int8"; None: fp32 everywhere)."""
        if len(routes) != len(self.parts):
            raise ValueError(f"one route tuple per part ({len(self.parts)}), got {len(routes)}.")
        self.routes = [r if r is not None and "int8" in r else None for r in routes]

    def _linear(self, x: torch.Tensor, index: int, bias: torch.Tensor | None) -> torch.Tensor:
        routes, part = self.routes[index], self.parts[index]
        if routes is not None:
            x2 = x.reshape(-1, part.in_features)
            if x2.shape[0] and routes[bucket_of(x2.shape[0])] == "int8":
                out = quant_linear_int8(x2, part, bias)
                return out.reshape(*x.shape[:-1], part.out_features)
        return quant_linear(x, part, bias)

    def apply(
        self,
        x: torch.Tensor,  # [..., in_features]
        bias: torch.Tensor | None,  # [out_features]
    ) -> torch.Tensor:  # [..., out_features]
        if len(self.parts) == 1:
            return self._linear(x, 0, bias)
        out = torch.cat([self._linear(x, i, None) for i in range(len(self.parts))], dim=-1)
        return out if bias is None else out + bias

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


class QuantizedEmbedding(nn.Module):
    """Embedding lookup from a quantized table: only the looked-up rows are dequantized."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.qweight = weight
        self.embedding_dim = weight.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        rows = self.qweight.take_rows(input_ids.reshape(-1).cpu())
        return rows.dequantize().reshape(*input_ids.shape, self.embedding_dim)


def check_quantizable(model: nn.Module, quantization: str) -> None:
    """NotImplementedError for models whose weights the quantized methods do not cover."""
    if any(hasattr(m, "expert_param_shards") for m in model.modules()):
        # The experts' stacked weights are not `Linear`s: quantizing only the attention
        # would give a half-quantized model that no reference computes.
        raise NotImplementedError(
            f"quantization={quantization!r} is not supported for mixture-of-experts models."
        )


def quantize_on_load(model: nn.Module, quantization: str) -> Callable[[str], None]:
    """The `on_loaded` callback of `load_weights` for int8: quantizes each projection once
    its weight is complete and releases the fp32 copy. ("gguf" weights are never fp32:
    engine/loader/gguf_weights.py fills them from the file.)"""
    check_quantizable(model, quantization)
    if quantization != "int8":
        raise ValueError(f"only int8 is quantized from fp32 weights, not {quantization!r}.")
    layers = {f"{name}.weight": layer for name, layer in projection_layers(model)}

    def loaded(param_name: str) -> None:
        layer = layers.get(param_name)
        if layer is not None and layer.quant_method is None:
            install_quantized(layer, [quantize_int8(layer.weight.data)], layer.weight.device)

    return loaded


def _linear_method(parts: list[QuantizedWeight], device: torch.device) -> LinearMethod:
    if device.type != "cpu":
        raise ValueError("quantized weights run on CPU only (no GPU dequant-GEMM yet).")
    return CPUQuantizedLinearMethod(parts)


def install_quantized(layer: Linear, parts: list[QuantizedWeight], device: torch.device) -> None:
    """Gives `layer` its quantized method for `device` and releases the fp32 weight (on a
    meta-built model: leaves it empty, so it never gets storage)."""
    layer.quant_method = _linear_method(parts, device)
    layer.packed_weight = None
    layer.weight = nn.Parameter(layer.weight.new_empty(0), requires_grad=False)


def projection_layers(model: nn.Module) -> list[tuple[str, Linear]]:
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, Linear) and name != "lm_head"
    ]
