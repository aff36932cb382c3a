"""Weights kept quantized behind the linear-layer interface (EngineArgs `quantization`).

The model is built and loaded as usual (fp32, from the dequantized checkpoint); then
`quantize_model` gives each projection `Linear` a `LinearMethod` that computes the layer
from the quantized weight and drops the fp32 copy. The model code is untouched: a `Linear`
with a `quant_method` calls it in `forward`.

- ``"gguf"``: the GGUF file's own blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; see
  engine/models/gguf_blocks.py) for every projection, and the embedding / LM head as the
  file stores them. Each block matrix is checked against the fp32 weight transformers
  dequantized from the same file, so a wrong name or permutation fails loudly at load.
- ``"int8"``: per-output-channel symmetric int8 of each projection (weight-only); the
  embedding and LM head stay in the checkpoint's dtype, as in vLLM's weight-only methods.

Only a CPU method exists today (`CPUQuantizedLinearMethod`, native kernels); a GPU one (a
Triton dequant-GEMM) would be another `LinearMethod` picked by `_linear_method`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from engine.models.linear import Linear
from engine.native.quant import QuantizedWeight, concat_rows, quant_linear, quantize_int8

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

    def apply(
        self,
        x: torch.Tensor,  # [..., in_features]
        bias: torch.Tensor | None,  # [out_features]
    ) -> torch.Tensor:  # [..., out_features]
        if len(self.parts) == 1:
            return quant_linear(x, self.parts[0], bias)
        out = torch.cat([quant_linear(x, part) for part in self.parts], dim=-1)
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


def quantize_model(
    model: nn.Module, quantization: str, hf_config: Any, gguf_file: Path | None = None
) -> int:
    """Switches `model`'s projections to quantized weights; returns how many layers."""
    if any(hasattr(m, "expert_param_shards") for m in model.modules()):
        # The experts' stacked weights are not `Linear`s: quantizing only the attention
        # would give a half-quantized model that no reference computes.
        raise NotImplementedError(
            f"quantization={quantization!r} is not supported for mixture-of-experts models."
        )
    if quantization == "int8":
        return _quantize_int8(model)
    if quantization == "gguf":
        if gguf_file is None:
            raise ValueError("quantization='gguf' needs the model's .gguf file.")
        return _use_gguf_blocks(model, gguf_file, hf_config)
    raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None.")


def _linear_method(parts: list[QuantizedWeight], device: torch.device) -> LinearMethod:
    if device.type != "cpu":
        raise ValueError("quantized weights run on CPU only (no GPU dequant-GEMM yet).")
    return CPUQuantizedLinearMethod(parts)


def _install(layer: Linear, parts: list[QuantizedWeight]) -> None:
    """Gives `layer` its quantized method and releases the fp32 weight."""
    layer.quant_method = _linear_method(parts, layer.weight.device)
    layer.packed_weight = None
    layer.weight = nn.Parameter(layer.weight.new_empty(0), requires_grad=False)


def _projection_layers(model: nn.Module) -> list[tuple[str, Linear]]:
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, Linear) and name != "lm_head"
    ]


def _quantize_int8(model: nn.Module) -> int:
    layers = _projection_layers(model)
    for _, layer in layers:
        _install(layer, [quantize_int8(layer.weight.data)])
    return len(layers)


def _use_gguf_blocks(model: nn.Module, gguf_file: Path, hf_config: Any) -> int:
    from engine.models.gguf_blocks import read_gguf_blocks

    blocks = read_gguf_blocks(gguf_file, hf_config)
    packed = getattr(model, "packed_modules_mapping", {})
    count = 0
    for name, layer in _projection_layers(model):
        prefix, _, leaf = name.rpartition(".")
        members = packed.get(leaf, (leaf,))
        keys = [f"{prefix}.{member}.weight" for member in members]
        if not all(key in blocks for key in keys):
            continue  # stored unquantized (F32/F16) in the file: stays fp32
        parts = _merge_same_type([blocks[key] for key in keys])
        _check_matches(name, parts, layer.weight.data)
        _install(layer, parts)
        count += 1
    count += _quantize_embedding_and_head(model, blocks)
    return count


def _merge_same_type(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """Fuses consecutive parts of one block type into one matrix (one kernel call)."""
    merged: list[list[QuantizedWeight]] = []
    for part in parts:
        if merged and merged[-1][0].qtype == part.qtype:
            merged[-1].append(part)
        else:
            merged.append([part])
    return [group[0] if len(group) == 1 else concat_rows(group) for group in merged]


def _quantize_embedding_and_head(model: nn.Module, blocks: dict[str, QuantizedWeight]) -> int:
    """The embedding table and the LM head as the file stores them (tied: one table)."""
    count = 0
    decoder = model.model
    embed = blocks.get("model.embed_tokens.weight")
    head = blocks.get("lm_head.weight")
    lm_head = getattr(model, "lm_head", None)
    if head is not None and lm_head is not None:
        _check_matches("lm_head", [head], lm_head.weight.data)
        model.quantized_logits = CPUQuantizedLinearMethod([head])
        lm_head.weight = nn.Parameter(lm_head.weight.new_empty(0), requires_grad=False)
        count += 1
    elif embed is not None and lm_head is None:  # tied: the head is the embedding table
        model.quantized_logits = CPUQuantizedLinearMethod([embed])
        count += 1
    if embed is not None:
        _check_matches("embed_tokens", [embed], decoder.embed_tokens.weight.data)
        decoder.embed_tokens = QuantizedEmbedding(embed)
        count += 1
    return count


def _check_matches(name: str, parts: list[QuantizedWeight], weight: torch.Tensor) -> None:
    """The blocks must dequantize to the fp32 weight loaded from the same file (up to the
    last bit: the two dequantizations may round d * q + m differently)."""
    dequantized = torch.cat([part.dequantize() for part in parts])
    if dequantized.shape != weight.shape:
        raise ValueError(
            f"GGUF blocks for {name} have shape {tuple(dequantized.shape)}, "
            f"the model expects {tuple(weight.shape)}."
        )
    tolerance = 1e-5 * (weight.abs().max().item() + 1e-12)
    error = (dequantized - weight.float()).abs().max().item()
    if error > tolerance:
        raise ValueError(
            f"GGUF blocks for {name} do not match the dequantized weight (max error {error:.3g})."
        )
