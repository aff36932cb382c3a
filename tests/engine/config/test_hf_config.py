"""The config readers that spare an engine's start the import of transformers
(engine/config/hf_config.py) give what transformers gives: on every config.json the fast path
takes, each attribute transformers' config holds (all of `to_dict()`, and the aliases the
engine reads) is equal, type included; every other config goes to transformers and comes back
as transformers' object (or its error). The generation config likewise, against
`GenerationConfig.to_diff_dict()`. Configs only: no weights."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import (
    AutoConfig,
    GenerationConfig,
    LlamaConfig,
    PreTrainedConfig,
    Qwen2Config,
)

from engine.config import hf_config
from engine.config.hf_config import (
    BASE_DEFAULTS,
    LLAMA_FIELDS,
    LightHFConfig,
    load_generation_dict,
    load_model_hf_config,
)

# Aliases and derived attributes the engine reads besides the stored fields.
_ALIASES = ("rope_scaling", "torch_dtype", "name_or_path", "num_labels", "id2label", "label2id")


def _tiny_llama_config(**overrides: Any) -> LlamaConfig:
    kwargs: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.15,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


REMOVE = object()  # an `edit` value: the key is taken out of config.json


def _write(path: Path, config: PreTrainedConfig, edit: dict[str, Any] | None = None) -> Path:
    """config.json as save_pretrained writes it, then `edit`'s keys set (or removed)."""
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    if edit:
        data = json.loads((path / "config.json").read_text())
        for key, value in edit.items():
            if value is REMOVE:
                data.pop(key, None)
            else:
                data[key] = value
        (path / "config.json").write_text(json.dumps(data))
    return path


def _assert_same(ours: Any, theirs: Any) -> None:
    names = set(theirs.to_dict()) | set(_ALIASES)
    for name in sorted(names):
        mine, expected = getattr(ours, name), getattr(theirs, name)
        assert mine == expected and type(mine) is type(expected), name
    assert set(vars(ours)) - {"_name_or_path"} <= set(theirs.to_dict()) | {"id2label"}


FAST = {
    "save_pretrained": ({}, None),
    "tied, head_dim, biases": (
        dict(tie_word_embeddings=True, head_dim=32, attention_bias=True, mlp_bias=True),
        None,
    ),
    "bf16 dtype, eos list, no kv heads": (
        dict(dtype="bfloat16", eos_token_id=[2, 7]),
        {"num_key_value_heads": None},
    ),
    # the default model's converted config.json: labels, unk token, the GGUF's name
    "labels and plain extras": (
        dict(
            dtype="float32",
            pad_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e5},
        ),
        {
            "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
            "label2id": {"LABEL_0": 0, "LABEL_1": 1},
            "unk_token_id": 0,
            "_model_name_or_path": "Smollm2 135M",
            "output_hidden_states": False,
            "return_dict": True,
            "is_encoder_decoder": False,
            "chunk_size_feed_forward": 0,
            "problem_type": None,
        },
    ),
    "head_dim null": ({}, {"head_dim": None}),
    "quantization_config": (
        {},
        {"quantization_config": {"quant_method": "compressed-tensors", "format": "x"}},
    ),
}


@pytest.mark.parametrize("case", sorted(FAST))
def test_the_light_config_holds_what_transformers_holds(tmp_path: Path, case: str):
    overrides, edit = FAST[case]
    path = _write(tmp_path / "m", _tiny_llama_config(**overrides), edit)
    ours = load_model_hf_config(path)
    assert isinstance(ours, LightHFConfig), "the fast path did not take this config"
    _assert_same(ours, AutoConfig.from_pretrained(path))


FALLBACK = {
    "another family": None,
    "transformers 4's rope_theta": {
        "rope_parameters": REMOVE,
        "rope_theta": 5e5,
        "transformers_version": "4.46.0",
    },
    "llama3 rope": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "an unknown key": {"sliding_window": 128},
    "a missing field": {"mlp_bias": REMOVE},
    "no version": {"transformers_version": REMOVE},
}


@pytest.mark.parametrize("case", sorted(FALLBACK))
def test_other_configs_go_to_transformers(tmp_path: Path, case: str):
    if case == "another family":
        config: PreTrainedConfig = Qwen2Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    else:
        config = _tiny_llama_config()
    path = _write(tmp_path / "m", config, FALLBACK[case])
    ours = load_model_hf_config(path)
    assert not isinstance(ours, LightHFConfig)
    theirs = AutoConfig.from_pretrained(path)
    assert type(ours) is type(theirs) and ours.to_dict() == theirs.to_dict()


@pytest.mark.parametrize(
    "edit",
    [{"hidden_size": 66}, {"initializer_range": 2.0}, {"vocab_size": "many"}, {"rms_norm_eps": 1}],
)
def test_a_config_transformers_refuses_is_refused_as_before(tmp_path: Path, edit: dict):
    path = _write(tmp_path / "m", _tiny_llama_config(), edit)
    with pytest.raises(Exception) as theirs:
        AutoConfig.from_pretrained(path)
    with pytest.raises(type(theirs.value)):
        load_model_hf_config(path)


def test_the_field_tables_are_transformers_own():
    """A transformers upgrade that adds or retypes a field fails here, not silently."""
    base = {f.name: f for f in dataclasses.fields(PreTrainedConfig)}
    llama = [f.name for f in dataclasses.fields(LlamaConfig) if f.name not in base]
    assert sorted(llama) == sorted(LLAMA_FIELDS)
    for name, default in BASE_DEFAULTS.items():
        if name == "output_attentions":
            assert LlamaConfig().output_attentions is default
        else:
            assert base[name].default == default, name
    assert set(base) <= set(BASE_DEFAULTS) | {"id2label", "label2id"}


GENERATION = {
    "token ids": {"bos_token_id": 1, "eos_token_id": [2, 7], "transformers_version": "4.40.0"},
    "every key read here": {
        "transformers_version": "5.0.0",
        "_from_model_config": True,
        "eos_token_id": [2, 3],
        "bos_token_id": 1,
        "pad_token_id": 0,
        "use_cache": True,
        "output_hidden_states": False,
        "output_attentions": False,
        "repetition_penalty": 1.1,
        "min_p": 0.1,
        "top_p": 0.9,
        "top_k": 5,
        "temperature": 0.5,
        "max_new_tokens": 7,
        "do_sample": True,
    },
    "from a model config": {
        "_from_model_config": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "output_attentions": False,
        "output_hidden_states": False,
        "use_cache": True,
        "transformers_version": "5.24.0",
    },
    "sampling": {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_new_tokens": 64,
        "eos_token_id": 2,
    },
    "greedy with a temperature": {"do_sample": False, "temperature": 0.7},
    "beams (transformers reads it)": {"num_beams": 4, "eos_token_id": 2},
    "nulls": {"eos_token_id": 2, "temperature": None},
}
GENERATION_VIA_TRANSFORMERS = {"beams (transformers reads it)"}


@pytest.mark.parametrize("case", sorted(GENERATION))
def test_the_generation_config_is_transformers_diff_dict(
    tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch
):
    (tmp_path / "generation_config.json").write_text(json.dumps(GENERATION[case]))
    theirs = GenerationConfig.from_pretrained(tmp_path).to_diff_dict()
    if case not in GENERATION_VIA_TRANSFORMERS:  # the fast path must not ask transformers

        def refused(model_dir: Path) -> None:
            raise AssertionError("went to transformers")

        monkeypatch.setattr(hf_config, "load_generation_config", refused)
    ours = load_generation_dict(tmp_path)
    assert ours == theirs
    assert json.dumps(ours) == json.dumps(theirs)  # the order too (vLLM's GetModelInfo)


def test_no_generation_config_is_empty(tmp_path: Path):
    assert load_generation_dict(tmp_path) == {}
