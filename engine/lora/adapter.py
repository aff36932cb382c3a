"""Loading a PEFT LoRA adapter, checked against the base model before anything uses it.

A PEFT directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`,
`target_modules`) and `adapter_model.safetensors` with, per adapted linear layer::

    base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_A.weight  [r, in_features]
    base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_B.weight  [out_features, r]

The layer computes ``y = x W^T + scaling * (x A^T) B^T`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rsLoRA). A bad adapter (a missing file, an unsupported target
module or option, a rank above `max_lora_rank`, a shape that does not fit the model) raises
a ValueError that says why, when it is loaded: never in the middle of a step.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The decoder's linear layers an adapter may target (q/k/v/o of attention, the MLP's three).
SUPPORTED_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
# PEFT options that change the layer's math or its set of weights: each must be off.
_OPTIONS_OFF = (
    ("use_dora", False),
    ("bias", "none"),
    ("lora_bias", False),
    ("fan_in_fan_out", False),
    ("modules_to_save", None),
    ("target_parameters", None),
    ("trainable_token_indices", None),
    ("layer_replication", None),
    ("use_qalora", False),
)
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


@dataclass(frozen=True)
class LoRALayerWeights:
    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank]
    scaling: float

    def delta(self) -> torch.Tensor:
        """The dense weight update ``scaling * B @ A``: [out_features, in_features]."""
        return self.scaling * (self.lora_b @ self.lora_a)


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    int_id: int
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], LoRALayerWeights]  # (layer index, module name) ->

    def layer_weights(self, layer: int, module: str) -> LoRALayerWeights | None:
        return self.weights.get((layer, module))


def linear_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each supported linear layer of the base model."""
    hidden = int(hf_config.hidden_size)
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // num_heads)
    intermediate = int(hf_config.intermediate_size)
    return {
        "q_proj": (num_heads * head_dim, hidden),
        "k_proj": (num_kv_heads * head_dim, hidden),
        "v_proj": (num_kv_heads * head_dim, hidden),
        "o_proj": (hidden, num_heads * head_dim),
        "gate_proj": (intermediate, hidden),
        "up_proj": (intermediate, hidden),
        "down_proj": (hidden, intermediate),
    }


def load_peft_adapter(
    path: str | Path,
    hf_config: Any,
    max_lora_rank: int,
    name: str = "",
    int_id: int = 1,
    dtype: torch.dtype = torch.float32,
) -> LoRAAdapter:
    """Reads and checks a PEFT LoRA directory against the base model's config."""
    directory = Path(path)
    config = _read_config(directory)
    rank, scaling, targets = _check_config(config, max_lora_rank)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ValueError(f"LoRA adapter at {directory}: {WEIGHTS_FILE} is missing.")
    tensors = load_file(str(weights_path))
    pairs = _pair_tensors(tensors, targets, int(hf_config.num_hidden_layers), directory)
    shapes = linear_shapes(hf_config)
    weights = {}
    for (layer, module), (lora_a, lora_b) in sorted(pairs.items()):
        out_features, in_features = shapes[module]
        expected_a, expected_b = (rank, in_features), (out_features, rank)
        if tuple(lora_a.shape) != expected_a or tuple(lora_b.shape) != expected_b:
            raise ValueError(
                f"LoRA adapter at {directory}: layers.{layer}.{module} has lora_A "
                f"{tuple(lora_a.shape)} and lora_B {tuple(lora_b.shape)}; the model needs "
                f"{expected_a} and {expected_b} (rank {rank})."
            )
        weights[(layer, module)] = LoRALayerWeights(
            lora_a.to(dtype).contiguous(), lora_b.to(dtype).contiguous(), scaling
        )
    return LoRAAdapter(name or directory.name, int_id, rank, scaling, targets, weights)


def _read_config(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise ValueError(f"LoRA adapter path {directory} is not a directory.")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"LoRA adapter at {directory}: {CONFIG_FILE} is missing.")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"LoRA adapter at {directory}: {CONFIG_FILE} is unreadable: {exc}"
        ) from exc
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter at {directory}: {CONFIG_FILE} is not a JSON object.")
    return config


def _check_config(config: dict[str, Any], max_lora_rank: int) -> tuple[int, float, tuple]:
    """(rank, scaling, target modules); a ValueError names the first unsupported setting."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type must be 'LORA', got {config.get('peft_type')!r}.")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"r (the LoRA rank) must be an int >= 1, got {rank!r}.")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank={max_lora_rank}.")
    for option, off in _OPTIONS_OFF:
        if config.get(option, off) not in (off, [], {}):
            raise ValueError(f"{option}={config[option]!r} is not supported (only {off!r}).")
    for option in ("rank_pattern", "alpha_pattern", "layers_pattern"):
        if config.get(option):
            raise ValueError(f"{option} is not supported (one rank and alpha per adapter).")
    targets = config.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise ValueError(
            f"target_modules must be a list of module names, got {targets!r} "
            f"(supported: {list(SUPPORTED_TARGET_MODULES)})."
        )
    unsupported = sorted(set(targets) - set(SUPPORTED_TARGET_MODULES))
    if unsupported:
        raise ValueError(
            f"target_modules {unsupported} are not supported; supported: "
            f"{list(SUPPORTED_TARGET_MODULES)}."
        )
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"lora_alpha must be a number, got {alpha!r}.")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling), tuple(sorted(set(targets)))


def _pair_tensors(
    tensors: dict[str, torch.Tensor], targets: tuple, num_layers: int, directory: Path
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """{(layer, module): (lora_A, lora_B)}; every tensor is accounted for."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"LoRA adapter at {directory}: unexpected tensor {key!r}.")
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in targets:
            raise ValueError(
                f"LoRA adapter at {directory}: tensor {key!r} is for {module!r}, which is "
                f"not in target_modules {list(targets)}."
            )
        if layer >= num_layers:
            raise ValueError(
                f"LoRA adapter at {directory}: tensor {key!r} is for layer {layer}; the "
                f"model has {num_layers} layers."
            )
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise ValueError(f"LoRA adapter at {directory}: {WEIGHTS_FILE} holds no LoRA tensor.")
    for (layer, module), pair in halves.items():
        if set(pair) != {"A", "B"}:
            missing = "lora_A" if "A" not in pair else "lora_B"
            raise ValueError(
                f"LoRA adapter at {directory}: layers.{layer}.{module} has no {missing}."
            )
    return {k: (v["A"], v["B"]) for k, v in halves.items()}
