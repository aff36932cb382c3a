"""GPT-OSS checkpoint tensors onto our stacked expert parameters (engine/layers/gpt_oss_moe.py).

The rest of a GPT-OSS checkpoint loads by the generic loader as it is (q/k/v into the fused
`qkv_proj`, `self_attn.sinks`, `mlp.router`); the experts come in one of two forms, both
stacked over the experts and both interleaving gate and up (gate at even rows, up at odd)::

    transformers (bf16/fp32 checkpoints, and what transformers 5 writes):
        mlp.experts.gate_up_proj [E, hidden, 2 * inter]   (x @ W: [in, out])
        mlp.experts.down_proj    [E, inter, hidden]
    the Hub's released weights (MXFP4, engine/loader/mxfp4.py), [out, in] once dequantized:
        mlp.experts.gate_up_proj_blocks [E, 2 * inter, hidden / 32, 16], _scales [.., hidden / 32]
        mlp.experts.down_proj_blocks    [E, hidden, inter / 32, 16],     _scales [.., inter / 32]
    both: mlp.experts.gate_up_proj_bias [E, 2 * inter], mlp.experts.down_proj_bias [E, hidden]

Ours are [out, in] with the gate rows first, then the up rows::

    mlp.w13_weight [E, 2 * inter, hidden]   mlp.w13_bias [E, 2 * inter]
    mlp.w2_weight  [E, hidden, inter]       mlp.w2_bias  [E, hidden]

A `_blocks` tensor waits for its `_scales` (either may come first, from any file).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from engine.loader.mxfp4 import dequantize_mxfp4

_EXPERTS = re.compile(
    r"^(?P<prefix>.+\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)(?P<part>_blocks|_scales|_bias)?$"
)
_TARGET = {"gate_up_proj": "w13", "down_proj": "w2"}


def _gate_then_up(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up (even/odd) along `dim` -> all gate, then all up."""
    size = tensor.shape[dim]
    return torch.cat(
        (
            tensor.index_select(dim, torch.arange(0, size, 2)),
            tensor.index_select(dim, torch.arange(1, size, 2)),
        ),
        dim,
    )


def _ours(prefix: str, proj: str, kind: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(our name, tensor) for an expert weight in [E, out, in] or a bias [E, out]."""
    dim = 1  # the out rows of a weight, the entries of a bias
    if proj == "gate_up_proj":
        tensor = _gate_then_up(tensor, dim)
    return f"{prefix}.{_TARGET[proj]}_{kind}", tensor


def gpt_oss_weights(
    weights: Iterable[tuple[str, Any]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) stream with the expert tensors renamed and laid out as
    ours; MXFP4 pairs dequantized to `dtype` (the model's)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}  # "<prefix>|<proj>" -> part -> tensor
    for name, tensor in weights:
        match = _EXPERTS.match(name)
        if match is None:
            yield name, tensor
            continue
        if not isinstance(tensor, torch.Tensor):  # a lazy safetensors slice, read whole
            tensor = tensor[:]
        prefix, proj, part = match["prefix"], match["proj"], match["part"]
        if part == "_bias":
            yield _ours(prefix, proj, "bias", tensor)
        elif part is None:  # transformers' [E, in, out]
            yield _ours(prefix, proj, "weight", tensor.transpose(1, 2))
        else:
            key = f"{prefix}|{proj}"
            parts = pending.setdefault(key, {})
            parts[part] = tensor
            if len(parts) == 2:
                del pending[key]
                weight = dequantize_mxfp4(parts["_blocks"], parts["_scales"], dtype)
                yield _ours(prefix, proj, "weight", weight)
    if pending:
        lone = sorted(
            f"{key.replace('|', '.experts.')}{part}"
            for key, parts in pending.items()
            for part in parts
        )
        raise ValueError(
            f"MXFP4 tensors without their pair (_blocks needs _scales): {', '.join(lone[:4])}."
        )
