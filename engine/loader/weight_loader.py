"""One generic weight loader for every family: checkpoint names to parameters, as data.

A model class declares how the checkpoint's names map onto its parameters:

- `packed_modules_mapping`: fused module -> the checkpoint modules it packs, in row order,
  e.g. ``{"qkv_proj": ("q_proj", "k_proj", "v_proj")}``. Shard i of a fused `Linear` lands
  at rows ``sum(output_sizes[:i])`` (see `engine.layers.linear.Linear`). A family whose
  checkpoint already stores the fused tensor (Phi-3) simply leaves the module out.
- `ignored_weight_suffixes`: checkpoint tensors we compute ourselves (rotary inv_freq).
- `expert_weights_mapping` (mixture-of-experts families): the per-expert checkpoint module
  -> (stacked parameter, shard), e.g. ``{"w1": ("w13_weight", 0), "w3": ("w13_weight", 1),
  "w2": ("w2_weight", None)}``: ``...experts.{e}.w1.weight`` fills expert e's first shard of
  ``...w13_weight`` (and ``...weight_scale`` the ``...w13_weight_scale`` of experts kept in
  FP8: engine/layers/fp8_moe.py). A module holding stacked expert weights declares their
  shards' row sizes in `expert_param_shards` (its FP8 scales' in `expert_scale_shards`).
  `weight_name_substitutions` renames first (Mixtral's ``.block_sparse_moe.`` is our
  ``.mlp.``).

Under tensor parallelism a module may declare `checkpoint_slices`: per parameter leaf,
the dimension and the `RowSlice` of each shard that this rank keeps
(engine/layers/parallel_layers.py); only those rows (or columns) are copied, and a lazy
safetensors slice reads nothing else from disk. Under pipeline parallelism, names under
`skipped_prefixes` belong to another stage and are passed over.

Every parameter (or shard) must be filled exactly by a tensor of its shape; unexpected,
missing or misshapen tensors raise ValueError naming them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from engine.distributed.sharding import RowSlice
from engine.layers.linear import Linear

# A checkpoint tensor, or a lazy safetensors slice of one (read only where indexed).
CheckpointTensor = Any


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
            # A parameter with one row per block of weight rows (a block-scaled FP8 scale
            # grid: engine/layers/fp8_block_linear.py) takes its shards at offsets / rows.
            row_blocks = getattr(module, "shard_row_blocks", {})
            for leaf, _ in module.named_parameters(recurse=False):
                rows = row_blocks.get(leaf, 1)
                shards[f"{module_name}.{leaf}"] = [(o // rows, n // rows) for o, n in offsets]
    return shards


def _target_name(ckpt_name: str, packed: Mapping[str, tuple[str, ...]]) -> tuple[str, int | None]:
    """Checkpoint name -> (our parameter name, shard index or None)."""
    parts = ckpt_name.split(".")
    if len(parts) >= 2:
        for fused, members in packed.items():
            if parts[-2] in members:
                return ".".join([*parts[:-2], fused, parts[-1]]), members.index(parts[-2])
    return ckpt_name, None


_EXPERT_NAME = re.compile(
    r"^(?P<prefix>.+)\.experts\.(?P<expert>\d+)\.(?P<leaf>\w+)\.weight(?P<scale>_scale)?$"
)


def _expert_shards(model: nn.Module) -> dict[str, list[tuple[int, int] | None]]:
    """Stacked expert parameter -> (row offset, rows) per shard, or [None] if unsharded."""
    shards: dict[str, list[tuple[int, int] | None]] = {}
    for module_name, module in model.named_modules():
        # FP8 experts' stacked scales (engine/layers/fp8_moe.py) shard as their weights do,
        # a block grid's rows in blocks.
        params = {
            **getattr(module, "expert_param_shards", {}),
            **getattr(module, "expert_scale_shards", {}),
        }
        for leaf, sizes in params.items():
            offsets: list[tuple[int, int] | None] = [None]
            if sizes is not None:
                offsets, start = [], 0
                for size in sizes:
                    offsets.append((start, size))
                    start += size
            shards[f"{module_name}.{leaf}"] = offsets
    return shards


def _checkpoint_slices(model: nn.Module) -> dict[str, tuple[int, tuple[RowSlice, ...]]]:
    """Parameter name -> (dimension, slice per shard) for tensor-parallel modules."""
    slices = {}
    for module_name, module in model.named_modules():
        for leaf, spec in getattr(module, "checkpoint_slices", {}).items():
            if getattr(module, leaf, None) is not None:
                slices[f"{module_name}.{leaf}"] = spec
    return slices


def _take(tensor: CheckpointTensor, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) `ranges` [(start, size)] of a tensor or lazy slice,
    concatenated; a 1-D tensor (a bias) is always cut along its only dimension."""
    if len(_shape(tensor)) == 1:
        dim = 0
    parts = []
    for start, size in ranges:
        index = (
            (slice(start, start + size),) if dim == 0 else (slice(None), slice(start, start + size))
        )
        parts.append(tensor[index])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _shape(tensor: CheckpointTensor) -> tuple[int, ...]:
    return tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tuple(tensor.get_shape())


def _sliced(
    tensor: CheckpointTensor, spec: tuple[int, tuple[RowSlice, ...]] | None, shard: int | None
) -> CheckpointTensor:
    """This rank's part of a checkpoint tensor: shard `shard`'s slice, or for a whole fused
    tensor (shard None, several slices) each shard's slice at its offset in the tensor."""
    if spec is None:
        return tensor
    dim, slices = spec
    if shard is not None:
        return _take(tensor, dim, [(slices[shard].start, slices[shard].size)])
    ranges, offset = [], 0
    for s in slices:
        ranges.append((offset + s.start, s.size))
        offset += s.full_size
    return _take(tensor, dim, ranges)


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, CheckpointTensor]],
    packed_modules_mapping: Mapping[str, tuple[str, ...]],
    ignored: tuple[str, ...] = (),
    expert_weights_mapping: Mapping[str, tuple[str, int | None]] | None = None,
    weight_name_substitutions: tuple[tuple[str, str], ...] = (),
    skipped_prefixes: tuple[str, ...] = (),
    on_loaded: Callable[[str], None] | None = None,
) -> None:
    """Copies checkpoint tensors into `model`'s (fused) parameters; checks every name.

    `ignored`: exact names or name suffixes (starting with '.') skipped on sight;
    `skipped_prefixes`: names held by another pipeline stage; `on_loaded(name)` is called
    as soon as parameter `name` has all its shards (int8 quantizes each projection then,
    so the whole model is never resident in fp32).
    """
    params = dict(model.named_parameters())
    shard_rows = _shard_rows(model, packed_modules_mapping)
    slices = _checkpoint_slices(model)
    expert_shards = _expert_shards(model)
    pending: set[tuple[str, object]] = set()
    for name in params:
        if params[name].numel() == 0:  # kept quantized (models/gguf_weights.py): not loaded
            continue
        if name in shard_rows:
            pending |= {(name, i) for i in range(len(shard_rows[name]))}
        elif name in expert_shards:
            num_experts, num_shards = params[name].shape[0], len(expert_shards[name])
            pending |= {(name, (e, i)) for e in range(num_experts) for i in range(num_shards)}
        else:
            pending.add((name, None))
    remaining = Counter(name for name, _ in pending)  # shards still to come, per parameter
    for ckpt_name, tensor in weights:
        if ckpt_name in ignored or any(s.startswith(".") and s in ckpt_name for s in ignored):
            continue
        if ckpt_name.startswith(skipped_prefixes):
            continue
        renamed = ckpt_name
        for old, new in weight_name_substitutions:
            renamed = renamed.replace(old, new)
        expert = _EXPERT_NAME.match(renamed) if expert_weights_mapping else None
        if expert is not None and expert["leaf"] in expert_weights_mapping:  # type: ignore[operator]
            leaf, index = expert_weights_mapping[expert["leaf"]]  # type: ignore[index]
            name = f"{expert['prefix']}.{leaf}{expert['scale'] or ''}"  # FP8 experts' scales too
            if name not in params or int(expert["expert"]) >= params[name].shape[0]:
                raise ValueError(f"unexpected weight {ckpt_name!r} for {type(model).__name__}.")
            target = params[name].data[int(expert["expert"])]
            rows = expert_shards[name][index or 0]
            if rows is not None:
                target = target.narrow(0, *rows)
            _copy(ckpt_name, tensor, target)
            pending.discard((name, (int(expert["expert"]), index or 0)))
            continue
        name, shard = _target_name(renamed, packed_modules_mapping)
        if name not in params:
            raise ValueError(f"unexpected weight {ckpt_name!r} for {type(model).__name__}.")
        if name in expert_shards:  # all experts stacked in one tensor (transformers 5's form)
            _copy(ckpt_name, tensor, params[name].data)
            pending = {p for p in pending if p[0] != name}
            continue
        target = params[name].data
        if shard is not None:
            start, size = shard_rows[name][shard]
            target = target.narrow(0, start, size)
        tensor = _sliced(tensor, slices.get(name), shard)
        rows = _shape(tensor)[0]
        if name in slices and rows < target.shape[0]:  # vocabulary padding rows stay zero
            target = target.narrow(0, 0, rows)
        _copy(ckpt_name, tensor, target)
        if (name, shard) in pending:
            pending.discard((name, shard))
            remaining[name] -= 1
            if remaining[name] == 0 and on_loaded is not None:
                on_loaded(name)
                # The callback may have replaced the parameter: hold the new one, so the
                # old storage is freed now rather than when loading ends.
                params[name] = model.get_parameter(name)
    if pending:
        missing = sorted(name if shard is None else f"{name}[{shard}]" for name, shard in pending)
        raise ValueError(f"missing weights: {', '.join(missing[:8])} ({len(missing)} in all).")


def _copy(ckpt_name: str, tensor: CheckpointTensor, target: torch.Tensor) -> None:
    if _shape(tensor) != tuple(target.shape):
        raise ValueError(
            f"weight {ckpt_name!r} has shape {_shape(tensor)}, expected {tuple(target.shape)}."
        )
    if not isinstance(tensor, torch.Tensor):  # a lazy slice read whole
        tensor = tensor[:]
    with torch.no_grad():
        target.copy_(tensor)
