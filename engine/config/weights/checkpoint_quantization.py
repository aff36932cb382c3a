"""Which quantized-checkpoint format a model directory holds, read once from its files.

A Hub checkpoint says how its weights are stored in `quantization_config` (config.json) or,
for NVIDIA ModelOpt exports, in hf_quant_config.json. `read_checkpoint_quantization` finds
that dictionary and hands it to the parser registered for its `quant_method` in `FORMATS`:
one entry per format, each a torch-free function that either returns what the engine runs
(`CheckpointQuantization`) or raises ValueError naming the field and value it does not serve,
so an unsupported checkpoint is refused at load instead of loaded as garbage.

    config.json quantization_config ─┐
    hf_quant_config.json (modelopt) ─┴─▶ quant_method ─▶ FORMATS[quant_method](config)
                                                          └─▶ CheckpointQuantization

    quant_method          engine method         scheme       loads as
    "compressed-tensors"  "fp8"                 Fp8Scheme    engine/loader/fp8_weights.py
      (format "float-quantized": per channel, per tensor or block)
    "compressed-tensors"  "compressed-tensors"  Int4Scheme   engine/loader/int4_weights.py
      (format "pack-quantized", 4-bit int weights)
    "modelopt"            "fp8"                 Fp8Scheme    engine/loader/fp8_weights.py
    "fp8" (transformers)  "fp8"                 Fp8Scheme    engine/loader/fp8_weights.py
      (block-scaled)
    "awq"                 "awq"                 Int4Scheme   engine/loader/int4_weights.py
    "gptq"                "gptq"                Int4Scheme   engine/loader/int4_weights.py

compressed-tensors' one entry routes by the config's `format`
(engine/config/weights/ct_int4_checkpoint.py).

`resolve_checkpoint_quantization` then checks `EngineArgs.quantization` against it (vLLM's
rule: the checkpoint's format wins; naming it, or "auto"/None, is the same). Families that
read their own quantized weights (GPT-OSS's MXFP4 experts) are passed over here:
`FAMILY_ARCHITECTURES`; DeepSeek-V3 takes its block-scaled FP8 through this table and
refuses the other formats in its own check (engine/models/deepseek_v3.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config.weights.block_fp8_checkpoint import parse_block_fp8
from engine.config.weights.ct_int4_checkpoint import parse_compressed_tensors
from engine.config.weights.fp8_checkpoint import Fp8Scheme, parse_modelopt
from engine.config.weights.int4_checkpoint import Int4Scheme, parse_awq, parse_gptq

MODELOPT_CONFIG_FILE = "hf_quant_config.json"


@dataclass(frozen=True, slots=True)
class CheckpointQuantization:
    """A checkpoint's quantization as the engine runs it."""

    quant_method: str  # the checkpoint's name for its format: "compressed-tensors", "awq", ...
    method: str  # the engine's method (`ModelConfig.quantization`): "fp8", "awq", "gptq", ...
    scheme: Fp8Scheme | Int4Scheme  # the method's settings, parsed from the config


def _int4(parse: Callable[[dict[str, Any]], Int4Scheme]) -> Callable[[dict[str, Any]], tuple]:
    def parse_int4(config: dict[str, Any]) -> tuple[str, Int4Scheme]:
        scheme = parse(config)
        return scheme.method, scheme

    return parse_int4


# quant_method -> parser. Each parser takes the format's config dictionary and returns
# (method, scheme), or raises ValueError naming the unsupported field.
FORMATS: dict[str, Callable[[dict[str, Any]], tuple[str, Any]]] = {
    "compressed-tensors": parse_compressed_tensors,
    "modelopt": parse_modelopt,
    "fp8": parse_block_fp8,  # transformers' FineGrainedFP8: block-scaled (DeepSeek, Qwen3)
    "awq": _int4(parse_awq),
    "gptq": _int4(parse_gptq),
}
# The engine's names for what FORMATS yields: a request for one of these needs such a checkpoint.
CHECKPOINT_METHODS = ("fp8", "awq", "gptq", "compressed-tensors")

# Architectures whose family reads `quantization_config` itself, in its check_config
# (GPT-OSS: MXFP4 experts dequantized at load): their configs pass through this table untouched.
FAMILY_ARCHITECTURES = ("GptOssForCausalLM",)


def checkpoint_quantization_config(model_dir: Path, hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's quantization dictionary: config.json's `quantization_config`, else
    ModelOpt's hf_quant_config.json (its `quantization` part, tagged quant_method
    "modelopt"), else None (an unquantized checkpoint)."""
    config = getattr(hf_config, "quantization_config", None)
    if config is not None and not isinstance(config, dict):
        to_dict = getattr(config, "to_dict", None)
        config = to_dict() if to_dict is not None else dict(vars(config))
    if config:
        return dict(config)
    path = Path(model_dir) / MODELOPT_CONFIG_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    producer = (data.get("producer") or {}).get("name")
    if producer != "modelopt":
        raise ValueError(f"{MODELOPT_CONFIG_FILE}: producer.name={producer!r} is not 'modelopt'.")
    return {"quant_method": "modelopt", **(data.get("quantization") or {})}


def read_checkpoint_quantization(model_dir: Path, hf_config: Any) -> CheckpointQuantization | None:
    """The checkpoint's quantization as the engine runs it, or None when it has none."""
    architectures = getattr(hf_config, "architectures", None) or ()
    if any(name in FAMILY_ARCHITECTURES for name in architectures):
        return None
    config = checkpoint_quantization_config(model_dir, hf_config)
    return None if config is None else parse_quantization_config(config)


def parse_quantization_config(config: dict[str, Any]) -> CheckpointQuantization:
    """A quantization dictionary as the engine runs it (ValueError naming the field)."""
    quant_method = config.get("quant_method")
    quant_method = getattr(quant_method, "value", quant_method)  # transformers' enum
    if isinstance(quant_method, str):
        quant_method = quant_method.lower()
    if quant_method not in FORMATS:
        raise ValueError(
            f"quantization_config.quant_method={quant_method!r} is not served; "
            f"checkpoints in {sorted(FORMATS)} are."
        )
    method, scheme = FORMATS[quant_method](config)
    return CheckpointQuantization(quant_method, method, scheme)


def resolve_checkpoint_quantization(
    requested: str | None, found: CheckpointQuantization | None, world_size: int = 1
) -> str | None:
    """`EngineArgs.quantization` for a quantized checkpoint: the checkpoint's method runs
    whether the user names it ("fp8", or the format's name as vLLM spells it), says "auto",
    or leaves it None; another method is refused (the weights are already quantized). For
    an unquantized checkpoint None (the other methods resolve in quantization.py), or
    ValueError when a checkpoint method was asked for."""
    if found is None:
        if requested in CHECKPOINT_METHODS or requested in FORMATS:
            raise ValueError(
                f"quantization={requested!r} needs a checkpoint stored that way (config.json's "
                f"quantization_config or {MODELOPT_CONFIG_FILE}); this one has none."
            )
        return None
    if requested not in (None, "auto", "none", found.method, found.quant_method):
        raise ValueError(
            f"quantization={requested!r}: the checkpoint is already quantized "
            f"(quantization_config.quant_method={found.quant_method!r}, {found.method}); "
            f"pass quantization='auto' or {found.method!r}."
        )
    if world_size > 1:
        # Quantized tensors are not split between ranks (yet), as for GGUF blocks.
        raise ValueError(
            f"quantization={found.method!r} needs tensor_parallel_size x "
            f"pipeline_parallel_size = 1, got {world_size}."
        )
    return found.method


def stays_quantized_on_cpu(found: CheckpointQuantization | None) -> bool:
    """Whether the checkpoint's weights can stay quantized in the native CPU kernels, which
    take fp32 activations: `dtype="auto"` then stays fp32 on a bf16 CPU, as for GGUF blocks."""
    return found is not None and isinstance(found.scheme, Int4Scheme) and found.scheme.fits_q4_0
