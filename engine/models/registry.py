"""Model registry: `config.json`'s `architectures` name -> our model class.

Classes are imported lazily by module path, so adding a family costs nothing to the start
of an engine that does not serve it. An architecture not listed here fails at load with
the list of the ones that are: nothing falls back to a look-alike model.
"""

from __future__ import annotations

import importlib
from typing import Any

# architecture -> (module under engine.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
}

# Configs without `architectures` (some GGUF conversions) are recognised by model_type.
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(hf_config: Any) -> str:
    """The config's architecture name; NotImplementedError listing ours when unsupported."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    if architectures:
        name = architectures[0]
        supported = name in _MODELS
    else:
        name = f"model_type={model_type!r}"
        supported = model_type in _MODEL_TYPES
    if not supported:
        raise NotImplementedError(
            f"architecture {name} is not supported; supported: "
            f"{', '.join(supported_architectures())}."
        )
    return architectures[0] if architectures else _MODEL_TYPES[str(model_type)]


def get_model_class(hf_config: Any) -> Any:
    """The model class for the config, after its family's own checks (`check_config`)."""
    module_name, class_name = _MODELS[resolve_architecture(hf_config)]
    cls = getattr(importlib.import_module(f"engine.models.{module_name}"), class_name)
    cls.check_config(hf_config)
    return cls
