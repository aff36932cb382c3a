"""FP8 checkpoint tensors (engine/config/weights/fp8_checkpoint.py) onto our modules, one of
two ways:

- **dequantized at load** (the CPU, and GPUs without FP8 tensor cores): each projection's
  ``weight`` (float8_e4m3fn) times its ``weight_scale`` becomes the model-dtype weight the
  generic loader copies in; nothing else changes, so the same directory runs everywhere.
- **kept in FP8** (sm_89+; forced on the CPU by the tests): `install_fp8_layers` gives every
  quantized projection an FP8 ``weight`` and an fp32 per-row ``weight_scale`` while the
  model is still on meta, with `Fp8LinearMethod` (engine/layers/fp8_linear.py) computing
  it; the stream then passes the FP8 weight through and spreads a per-tensor scale over its
  rows, so the generic loader fills a fused q|k|v shard by shard, each with its own scale::

      q_proj.weight fp8 [Nq, K], q_proj.weight_scale [] ──▶ qkv_proj.weight rows [0, Nq)
                                                        ──▶ qkv_proj.weight_scale [0, Nq) = s_q

Block-scaled checkpoints (``weight_strategy == "block"``: transformers' ``weight_scale_inv``
or compressed-tensors' ``weight_scale``, one fp32 scale per [rows, cols] block, ragged at the
edges) pass through as FP8 weight + fp32 scale grid for the layers
engine/loader/block_fp8_weights.py kept (CUDA), and are dequantized at load for the rest
(every layer elsewhere). Each dequantized pair is expanded exactly as it streams in::

    weight fp8 [N, K] ──zero-pad──▶ fp32 [nb*rows, kb*cols] = view [nb, rows, kb, cols]
      *= scale [nb, 1, kb, 1] ──crop──▶ [N, K] ──▶ model dtype

In every way ``input_scale`` / ``activation_scale`` are dropped (activations are not
quantized on the dequantized path, and quantized per token on the FP8 one:
engine/layers/fp8_linear.py says why) and the KV-cache ``k_scale`` / ``v_scale`` tensors
are collected into `Fp8Checkpoint.kv_scales`. A weight waits for its scale (either may come
first, from any file); a lone one is an error, and so is an FP8 tensor that is not a
module's weight (it would load as unscaled numbers). Names under `Fp8Checkpoint.skipped`
(layers another stage, or nothing, loads: DeepSeek's multi-token prediction layers) pass
through as they are, not dequantized.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.config.weights.fp8_checkpoint import Fp8Scheme, is_ignored
from engine.layers.fp8_block_linear import scale_grid_shape
from engine.layers.fp8_linear import FP8_DTYPE, Fp8LinearMethod, Gemv, Quantizer, ScaledMM
from engine.layers.linear import Linear

_QUANT_TENSOR = re.compile(
    r"^(?P<module>.+)\.(?P<leaf>weight|weight_scale(?:_inv)?|input_scale|activation_scale)$"
)
# transformers' names for the scales (FineGrainedFP8) -> compressed-tensors' ones
_LEAF_NAMES = {"weight_scale_inv": "weight_scale", "activation_scale": "input_scale"}
_KV_SCALE = re.compile(r"^(?P<attn>.+?)(?:\.[kv]_proj)?\.(?P<kv>k_scale|v_scale)$")


def dequantize_fp8(
    weight: torch.Tensor,  # fp8 [N, K]
    scale: torch.Tensor,  # fp32 [N, 1] / [N] (per channel) or [] / [1] (per tensor)
    dtype: torch.dtype,
) -> torch.Tensor:  # [N, K] of `dtype`
    return (weight.float() * _row_scales(scale, weight.shape[0])[:, None]).to(dtype)


def dequantize_block_fp8(
    weight: torch.Tensor,  # fp8 [N, K]
    scale: torch.Tensor,  # fp32 (or ue8m0) [ceil(N / rows), ceil(K / cols)]
    block_size: tuple[int, int],  # (rows, cols)
    dtype: torch.dtype,
) -> torch.Tensor:  # [N, K] of `dtype`
    """weight[i, j] * scale[i // rows, j // cols], ragged edge blocks included; each product
    is one fp32 multiply, so it is the exact product rounded once to fp32."""
    rows, cols = block_size
    n, k = weight.shape
    num_row_blocks, num_col_blocks = check_block_grid(weight, scale, block_size)
    scale = block_scales_fp32(scale)
    padded = weight.new_zeros(num_row_blocks * rows, num_col_blocks * cols, dtype=torch.float32)
    padded[:n, :k] = weight  # exact: every E4M3 value is an fp32 value
    blocks = padded.view(num_row_blocks, rows, num_col_blocks, cols)
    blocks.mul_(scale.float()[:, None, :, None])
    return padded[:n, :k].to(dtype).contiguous()


def check_block_grid(
    weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int]
) -> tuple[int, int]:
    """The scale grid's shape [ceil(N / rows), ceil(K / cols)], or ValueError naming both."""
    rows, cols = block_size
    n, k = weight.shape
    grid = scale_grid_shape(n, k, block_size)
    if tuple(scale.shape) != grid:
        raise ValueError(
            f"a block-scaled FP8 weight [{n}, {k}] with blocks [{rows}, {cols}] needs scales "
            f"{list(grid)}, got {list(scale.shape)}."
        )
    return grid


def block_scales_fp32(scale: torch.Tensor) -> torch.Tensor:
    """A block scale grid as fp32 (exact: ue8m0 scales, stored as float8_e8m0fnu or as
    bytes 2^(byte - 127), are powers of two)."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    return scale.float().contiguous()


def _row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:  # fp32 [rows]
    scale = scale.float().reshape(-1)
    if scale.numel() == 1:
        return scale.expand(rows).contiguous()
    if scale.numel() != rows:
        raise ValueError(f"an FP8 weight of {rows} rows has {scale.numel()} scales.")
    return scale


@dataclass
class Fp8Checkpoint:
    """How one load treats the checkpoint's FP8 tensors."""

    scheme: Fp8Scheme
    dtype: torch.dtype  # the model's (dequantized weights)
    kept: frozenset[str] = frozenset()  # checkpoint modules whose weights stay FP8
    # "<attention module>" -> {"k_scale": s, "v_scale": s}, as the checkpoint has them
    kv_scales: dict[str, dict[str, float]] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()  # name prefixes the model does not load: passed through

    def weights(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint stream with FP8 pairs dequantized or kept (see the module doc)."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            if self.skipped and name.startswith(self.skipped):
                yield name, tensor
                continue
            kv = _KV_SCALE.match(name)
            if kv is not None:
                self.kv_scales.setdefault(kv["attn"], {})[kv["kv"]] = float(_whole(tensor))
                continue
            match = _QUANT_TENSOR.match(name)
            if match is None:
                if isinstance(tensor, torch.Tensor) and tensor.dtype == FP8_DTYPE:
                    raise ValueError(f"{name!r} is {FP8_DTYPE} but not a module's weight.")
                yield name, tensor
                continue
            module, leaf = match["module"], _LEAF_NAMES.get(match["leaf"], match["leaf"])
            if leaf == "input_scale":
                continue
            tensor = _whole(tensor)
            if leaf == "weight" and tensor.dtype != FP8_DTYPE and module not in pending:
                if module in self.kept:
                    raise ValueError(f"{name!r} is {tensor.dtype}; the config makes it FP8.")
                yield name, tensor  # an unquantized module (ignored, or not a projection)
                continue
            parts = pending.setdefault(module, {})
            parts[leaf] = tensor
            if len(parts) == 2:
                del pending[module]
                yield from self._pair(module, parts["weight"], parts["weight_scale"])
        if pending:
            lone = sorted(f"{m}.{leaf}" for m, parts in pending.items() for leaf in parts)
            raise ValueError(f"FP8 tensors without their pair (weight, weight_scale): {lone[:4]}.")

    def _pair(
        self, module: str, weight: torch.Tensor, scale: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if weight.dtype != FP8_DTYPE:
            raise ValueError(f"{module}.weight is {weight.dtype}, expected {FP8_DTYPE}.")
        if self.scheme.block_size is not None:
            block = self.scheme.block_size
            try:
                check_block_grid(weight, scale, block)
            except ValueError as error:
                raise ValueError(f"{module}: {error}") from None
            if module in self.kept:  # a block FP8 layer: engine/layers/fp8_block_linear.py
                yield f"{module}.weight", weight
                yield f"{module}.weight_scale", block_scales_fp32(scale)
            else:
                yield f"{module}.weight", dequantize_block_fp8(weight, scale, block, self.dtype)
        elif module in self.kept:
            yield f"{module}.weight", weight
            yield f"{module}.weight_scale", _row_scales(scale, weight.shape[0])
        else:
            yield f"{module}.weight", dequantize_fp8(weight, scale, self.dtype)


def _whole(tensor: Any) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor[:]  # a lazy slice


def checkpoint_modules(
    name: str, layer: Linear, packed: Mapping[str, tuple[str, ...]]
) -> list[str]:
    """The checkpoint modules a (fused) layer of ours is filled from."""
    prefix, _, leaf = name.rpartition(".")
    if layer.output_sizes is not None and leaf in packed:
        return [f"{prefix}.{member}" if prefix else member for member in packed[leaf]]
    return [name]


def quantized_linears(
    model: nn.Module, scheme: Fp8Scheme, packed: Mapping[str, tuple[str, ...]]
) -> Iterator[tuple[str, Linear, list[str]]]:
    """(name, layer, its checkpoint modules) of every projection the config quantizes: the
    LM head and the modules `scheme.ignore` names are not; a fused layer whose members the
    config treats differently is refused. An MoE router (`is_router`) is never kept FP8:
    the releases keep it float, and one that quantizes it has it dequantized at load (a
    few KB a layer, and the routing decisions are the most sensitive to rounding)."""
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear) or name.rsplit(".", 1)[-1] == "lm_head":
            continue
        if getattr(layer, "is_router", False):
            continue
        members = checkpoint_modules(name, layer, packed)
        ignored = [is_ignored(m, scheme.ignore) for m in members]
        if all(ignored):
            continue
        if any(ignored):
            raise NotImplementedError(
                f"{name}: the checkpoint quantizes some of {members} and not others."
            )
        yield name, layer, members


def install_fp8_layers(
    model: nn.Module,
    scheme: Fp8Scheme,
    packed: Mapping[str, tuple[str, ...]],
    scaled_mm: ScaledMM = torch._scaled_mm,
    quantize: Quantizer | None = None,
    gemv: Gemv | None = None,
) -> frozenset[str]:
    """On a meta-built model: every projection the config quantizes gets an FP8 `weight`,
    an fp32 `weight_scale` per output row and `Fp8LinearMethod` (with the decode-row
    `gemv` where there is one: CUDA); returns the checkpoint modules now kept in FP8. The
    LM head and embedding are dequantized (a `Linear` only)."""
    kept: set[str] = set()
    for _, layer, members in quantized_linears(model, scheme, packed):
        out_features, in_features = layer.weight.shape
        layer.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=layer.weight.device),
            requires_grad=False,
        )
        layer.weight_scale = nn.Parameter(
            torch.empty(out_features, dtype=torch.float32, device=layer.weight.device),
            requires_grad=False,
        )
        layer.packed_weight = None
        layer.quant_method = Fp8LinearMethod(layer, scaled_mm, quantize, gemv)
        kept.update(members)
    return frozenset(kept)
