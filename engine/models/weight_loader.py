"""One generic weight loader for every family: checkpoint names to parameters, as data.

A model class declares how the checkpoint's names map onto its parameters:

- `packed_modules_mapping`: fused module -> the checkpoint modules it packs, in row order,
  e.g. ``{"qkv_proj": ("q_proj", "k_proj", "v_proj")}``. Shard i of a fused `Linear` lands
  at rows ``sum(output_sizes[:i])`` (see `engine.models.linear.Linear`). A family whose
  checkpoint already stores the fused tensor (Phi-3) simply leaves the module out.
- `ignored_weight_suffixes`: checkpoint tensors we compute ourselves (rotary inv_freq).

Every parameter (or shard) must be filled exactly by a tensor of its shape; unexpected,
missing or misshapen tensors raise ValueError naming them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from engine.models.linear import Linear


def _shard_rows(
    model: nn.Module, packed: Mapping[str, tuple[str, ...]]
) -> dict[str, list[tuple[int, int]]]:
    """Fused parameter name -> (row offset, rows) of each shard, from `output_sizes`, for
    the modules the checkpoint stores as separate tensors."""
    shards: dict[str, list[tuple[int, int]]] = {}
    for module_name, module in model.named_modules():
        if (
            isinstance(module, Linear)
            and module.output_sizes is not None
            and module_name.rsplit(".", 1)[-1] in packed
        ):
            offsets, start = [], 0
            for size in module.output_sizes:
                offsets.append((start, size))
                start += size
            for leaf, _ in module.named_parameters(recurse=False):
                shards[f"{module_name}.{leaf}"] = offsets
    return shards


def _target_name(ckpt_name: str, packed: Mapping[str, tuple[str, ...]]) -> tuple[str, int | None]:
    """Checkpoint name -> (our parameter name, shard index or None)."""
    parts = ckpt_name.split(".")
    if len(parts) >= 2:
        for fused, members in packed.items():
            if parts[-2] in members:
                return ".".join([*parts[:-2], fused, parts[-1]]), members.index(parts[-2])
    return ckpt_name, None


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules_mapping: Mapping[str, tuple[str, ...]],
    ignored: tuple[str, ...] = (),
) -> None:
    """Copies checkpoint tensors into `model`'s (fused) parameters; checks every name.

    `ignored`: exact names or name suffixes (starting with '.') skipped on sight.
    """
    params = dict(model.named_parameters())
    shard_rows = _shard_rows(model, packed_modules_mapping)
    pending: set[tuple[str, int | None]] = set()
    for name in params:
        if name in shard_rows:
            pending |= {(name, i) for i in range(len(shard_rows[name]))}
        else:
            pending.add((name, None))
    for ckpt_name, tensor in weights:
        if ckpt_name in ignored or any(s.startswith(".") and s in ckpt_name for s in ignored):
            continue
        name, shard = _target_name(ckpt_name, packed_modules_mapping)
        if name not in params:
            raise ValueError(f"unexpected weight {ckpt_name!r} for {type(model).__name__}.")
        target = params[name].data
        if shard is not None:
            start, size = shard_rows[name][shard]
            target = target.narrow(0, start, size)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"weight {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(target.shape)}."
            )
        with torch.no_grad():
            target.copy_(tensor)
        pending.discard((name, shard))
    if pending:
        missing = sorted(name if shard is None else f"{name}[{shard}]" for name, shard in pending)
        raise ValueError(f"missing weights: {', '.join(missing[:8])} ({len(missing)} in all).")
