"""The engine's `max_model_len` as vLLM derives it from the model's config (its
`_get_and_verify_max_len`): `max_position_embeddings` stretched by the rope's `factor` for
every rope type but longrope and llama3, yarn from `original_max_position_embeddings`; the
default is that length (a longrope model's: its pretraining length), and a larger request is
refused naming both lengths. Configs only: no weights, no torch model."""

from __future__ import annotations

import pytest
from transformers import Gemma3TextConfig, LlamaConfig, Phi3Config

from engine.config.rope import default_max_model_len, derived_max_model_len

MAX_POS = 64
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# rope dict -> the derived length for max_position_embeddings = MAX_POS
CASES = {
    "none": (None, MAX_POS),
    "default": ({"rope_type": "default"}, MAX_POS),
    "linear": ({"rope_type": "linear", "factor": 4.0}, 4 * MAX_POS),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, 2 * MAX_POS),
    "dynamic-legacy-type-key": ({"type": "dynamic", "factor": 3.0}, 3 * MAX_POS),
    "yarn-from-original": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        128,
    ),
    "yarn-original-below-max-pos": (
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16},
        32,
    ),
    "llama3-unstretched": (LLAMA3, MAX_POS),
}


def _llama(rope: dict | None, **kwargs) -> LlamaConfig:
    return LlamaConfig(max_position_embeddings=MAX_POS, rope_scaling=rope, **kwargs)


@pytest.mark.parametrize("name", list(CASES))
def test_derived_length_of_each_rope_type(name: str) -> None:
    rope, expected = CASES[name]
    config = _llama(rope)
    assert derived_max_model_len(config) == expected
    assert default_max_model_len(config) == expected


def test_longrope_is_unstretched_and_defaults_to_its_pretraining_length() -> None:
    half = 8  # head_dim 16
    config = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=128,
        original_max_position_embeddings=32,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0] * half,
            "long_factor": [2.0] * half,
        },
    )
    assert derived_max_model_len(config) == 128
    assert default_max_model_len(config) == 32


def test_gemma3_length_is_already_scaled() -> None:
    """Gemma 3 keeps a linear factor on its full-attention layers, but its
    max_position_embeddings already is the scaled length (vLLM skips the stretch too)."""
    config = Gemma3TextConfig(
        max_position_embeddings=MAX_POS,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    assert derived_max_model_len(config) == MAX_POS


def test_engine_default_and_limit_follow_the_derivation(tmp_path) -> None:
    """Through `EngineArgs`: the default is the stretched length, one token more is refused
    with both numbers in the message."""
    from engine.config.engine_config import EngineArgs
    from tests.model_utils import make_tiny_llama

    path = make_tiny_llama(
        tmp_path,
        max_position_embeddings=MAX_POS,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    config = EngineArgs(model=str(path), device="cpu").create_engine_config()
    assert config.model_config.max_model_len == 2 * MAX_POS
    with pytest.raises(ValueError, match=rf"max_model_len \({2 * MAX_POS + 1}\).*{2 * MAX_POS}"):
        EngineArgs(
            model=str(path), device="cpu", max_model_len=2 * MAX_POS + 1
        ).create_engine_config()
