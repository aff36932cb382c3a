"""The model's config and generation config, read from the directory's JSON files without
importing transformers where that gives exactly what transformers would.

Why: `AutoConfig.from_pretrained` imports transformers' lazy import structure and, through
every config class's module, `transformers.activations` -> `integrations.hub_kernels` ->
`core_model_loading` -> `torch.distributed.tensor` and sympy: 2-3 s of an engine's start on a
2-core machine, longer than torch itself, for a few dozen numbers (docs/benchmarks.md,
"Engine start-up"). The engine's modelling code is its own and the engine service loads no
tokenizer, so nothing else on that service's start path imports the package.

What is read here, and what is handed to transformers as before:

    config.json written by transformers 5 (`save_pretrained`: the tests' tiny models, the
    default model's GGUF conversion) for a Llama model, with every Llama field present and
    valid, only keys known here, a plain default rope
        -> `LightHFConfig`: the same attributes and values as transformers' `LlamaConfig`
    anything else (other families, configs of older transformers with `rope_theta` /
    `rope_scaling` to standardise, unknown keys, values transformers would reject or coerce)
        -> `AutoConfig.from_pretrained`, unchanged (its errors included)

    generation_config.json with only token ids, bookkeeping and the sampling fields the
    engine reads, each a plain value transformers keeps as is
        -> its set values (what `GenerationConfig.to_diff_dict()` returns: every field here
           defaults to None in transformers 5)
    anything else -> `GenerationConfig.from_pretrained(...).to_diff_dict()`, unchanged

tests/engine/config/test_hf_config.py holds both readers to transformers' results, field by
field, on the configs the fast paths take, and checks that the others fall back.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
from pathlib import Path
from typing import Any

from engine.api.model_files import load_generation_config, load_hf_config

# LlamaConfig's own fields (transformers 5) and their types; a config.json taking the fast
# path sets every one of them (save_pretrained writes a model's own fields always).
_INT, _FLOAT, _BOOL, _STR = (int,), (float,), (bool,), (str,)
LLAMA_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {  # name -> (types, None allowed)
    "vocab_size": (_INT, False),
    "hidden_size": (_INT, False),
    "intermediate_size": (_INT, False),
    "num_hidden_layers": (_INT, False),
    "num_attention_heads": (_INT, False),
    "num_key_value_heads": (_INT, True),
    "hidden_act": (_STR, False),
    "max_position_embeddings": (_INT, False),
    "initializer_range": (_FLOAT, False),
    "rms_norm_eps": (_FLOAT, False),
    "use_cache": (_BOOL, False),
    "pad_token_id": (_INT, True),
    "bos_token_id": (_INT, True),
    "eos_token_id": ((int, list), True),
    "pretraining_tp": (_INT, True),
    "tie_word_embeddings": (_BOOL, False),
    "rope_parameters": ((dict,), False),
    "attention_bias": (_BOOL, False),
    "attention_dropout": ((int, float), True),
    "mlp_bias": (_BOOL, False),
    "head_dim": (_INT, True),
}
# PreTrainedConfig's fields as a config object holds them when config.json leaves them out
# (save_pretrained drops those equal to these defaults).
BASE_DEFAULTS: dict[str, Any] = {
    "transformers_version": None,
    "architectures": None,
    "output_hidden_states": False,
    "return_dict": True,
    "dtype": None,
    "chunk_size_feed_forward": 0,
    "is_encoder_decoder": False,
    "problem_type": None,
    "output_attentions": False,
}
# Keys transformers sets on the config as they are (no conversion, no validation).
_PLAIN_EXTRA_KEYS = ("model_type", "unk_token_id", "_model_name_or_path", "quantization_config")
_DTYPES = ("float32", "float16", "bfloat16")

# generation_config.json keys read without transformers: all default to None there, and
# transformers keeps them as given.
_GENERATION_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
_GENERATION_FLAGS = ("_from_model_config", "use_cache", "output_attentions", "output_hidden_states")
_GENERATION_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# The order `to_diff_dict()` gives them in (the vLLM protocol's GetModelInfo sends the dict
# as JSON, so the order shows), ending with the installed transformers' version.
_GENERATION_ORDER = (
    "max_new_tokens",
    "do_sample",
    "use_cache",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "output_attentions",
    "output_hidden_states",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "_from_model_config",
)


class LightHFConfig:
    """A model config read from config.json: its keys as attributes, as transformers'
    config object holds them (`to_dict()` gives them back, as transformers' does)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    @property
    def rope_scaling(self) -> Any:
        """transformers 5's alias of `rope_parameters`."""
        return self.rope_parameters

    @property
    def torch_dtype(self) -> Any:
        """transformers 5's alias of `dtype`."""
        return self.dtype

    @property
    def name_or_path(self) -> str:
        return str(self._name_or_path)

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    def to_dict(self) -> dict[str, Any]:
        values = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        values["_name_or_path"] = self._name_or_path
        if values.get("dtype") is not None:
            values["dtype"] = str(values["dtype"]).removeprefix("torch.")
        return values

    def __repr__(self) -> str:
        return f"LightHFConfig({json.dumps(self.to_dict(), sort_keys=True, default=str)})"


def load_model_hf_config(model_dir: Path) -> Any:
    """The model's config: a `LightHFConfig` where config.json is one the fast path takes,
    else transformers' (`AutoConfig.from_pretrained`)."""
    path = Path(model_dir) / "config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    values = light_llama_values(data) if isinstance(data, dict) else None
    if values is None:
        return load_hf_config(model_dir)
    values["_name_or_path"] = str(model_dir)
    if values["dtype"] is not None:
        import torch  # the engine's process has it; this module's importers need not

        values["dtype"] = getattr(torch, values["dtype"])
    return LightHFConfig(values)


def light_llama_values(data: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's values as transformers' LlamaConfig holds them, or None when only
    transformers can say (see the module docstring)."""
    if data.get("model_type") != "llama" or not _written_by_transformers_5(data):
        return None
    known = {*LLAMA_FIELDS, *BASE_DEFAULTS, *_PLAIN_EXTRA_KEYS, "id2label", "label2id"}
    if not known.issuperset(data) or not all(_valid_field(data, n) for n in LLAMA_FIELDS):
        return None
    if not _valid_base(data) or not _plain_default_rope(data["rope_parameters"]):
        return None
    values = {**BASE_DEFAULTS, **data}
    values["rope_parameters"] = dict(data["rope_parameters"])
    if values["head_dim"] is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if "id2label" in data:
        values["id2label"] = {int(k): v for k, v in data["id2label"].items()}
    else:
        values["id2label"] = {0: "LABEL_0", 1: "LABEL_1"}
        values.setdefault("label2id", {"LABEL_0": 0, "LABEL_1": 1})
    return values


def _written_by_transformers_5(data: dict[str, Any]) -> bool:
    version = data.get("transformers_version")
    if not isinstance(version, str):
        return False
    major = version.split(".", 1)[0]
    return major.isdigit() and int(major) >= 5


def _valid_field(data: dict[str, Any], name: str) -> bool:
    """Present, of LlamaConfig's type, and in range where LlamaConfig checks a range."""
    if name not in data:
        return False
    types, nullable = LLAMA_FIELDS[name]
    value = data[name]
    if value is None:
        return nullable
    if isinstance(value, bool) and bool not in types:
        return False
    if not isinstance(value, types):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if isinstance(value, list):
        return all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if name == "initializer_range":
        return 0.0 <= value <= 1.0
    if name in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size") and (
        value <= 0
    ):
        return False
    if name == "num_attention_heads":  # LlamaConfig.validate_architecture
        hidden_size = data.get("hidden_size")
        return type(hidden_size) is int and hidden_size % value == 0
    return True


def _valid_base(data: dict[str, Any]) -> bool:
    """PreTrainedConfig's own keys hold plain values transformers keeps as they are."""
    checks = (
        data.get("dtype") is None or data.get("dtype") in _DTYPES,
        data.get("problem_type") is None,
        data.get("output_attentions", False) is False,
        isinstance(data.get("output_hidden_states", False), bool),
        isinstance(data.get("return_dict", True), bool),
        data.get("is_encoder_decoder", False) is False,
        type(data.get("chunk_size_feed_forward", 0)) is int,
        _str_list(data.get("architectures", [])),
        _labels(data),
    )
    return all(checks)


def _str_list(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def _labels(data: dict[str, Any]) -> bool:
    """id2label and label2id both absent, or both given as str -> str / str -> int maps."""
    if "id2label" not in data and "label2id" not in data:
        return True
    id2label, label2id = data.get("id2label"), data.get("label2id")
    if not isinstance(id2label, dict) or not isinstance(label2id, dict) or not id2label:
        return False
    keys_ok = all(k.lstrip("-").isdigit() and isinstance(v, str) for k, v in id2label.items())
    return keys_ok and all(type(v) is int for v in label2id.values())


def _plain_default_rope(rope: dict[str, Any]) -> bool:
    """{"rope_type": "default", "rope_theta": <number>}: what transformers 5 standardises a
    plain rope to, so it has nothing left to change or check."""
    theta = rope.get("rope_theta")
    return (
        set(rope) == {"rope_type", "rope_theta"}
        and rope["rope_type"] == "default"
        and isinstance(theta, int | float)
        and not isinstance(theta, bool)
        and math.isfinite(theta)
        and theta > 0
    )


def load_generation_dict(model_dir: Path) -> dict[str, Any]:
    """generation_config.json's set values, as `GenerationConfig.to_diff_dict()` returns
    them ({} without the file): read directly where the file holds only plain keys."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, dict) and _plain_generation_config(data):
        values = {key: data[key] for key in _GENERATION_ORDER if data.get(key) is not None}
        # to_diff_dict() writes the version of the transformers that reads the file
        values["transformers_version"] = importlib.metadata.version("transformers")
        return values
    generation = load_generation_config(model_dir)
    return generation.to_diff_dict() if generation is not None else {}


def _plain_generation_config(data: dict[str, Any]) -> bool:
    for key, value in data.items():
        if value is None:
            continue
        if key in _GENERATION_TOKEN_KEYS:
            ok = _token_ids(value)
        elif key in _GENERATION_FLAGS:
            ok = isinstance(value, bool)
        elif key == "transformers_version":
            ok = isinstance(value, str)
        elif key == "do_sample":
            ok = isinstance(value, bool)
        elif key in _GENERATION_SAMPLING:
            ok = _number(value)
        elif key == "max_new_tokens":
            ok = type(value) is int and value > 0
        else:
            ok = False
        if not ok:
            return False
    return True


def _token_ids(value: Any) -> bool:
    values = value if isinstance(value, list) else [value]
    return all(type(v) is int for v in values)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
