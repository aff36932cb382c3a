"""`load_format="dummy"`: an engine from a config.json alone, with random weights.

The GPU benchmarks build a Llama-3.1-8B-shaped model this way on a machine without the hub
(benchmarks/gpu/gpu_decode.py). Here a tiny config: the engine serves tokens, every weight is
drawn in vLLM's range (none left uninitialised), and the same seed draws the same model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from engine import LLM, EngineArgs, SamplingParams
from engine.loader.dummy_weights import DUMMY_RANGE


def _config_only(path: Path) -> Path:
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    config.save_pretrained(path)
    assert [p.name for p in path.iterdir()] == ["config.json"]  # no weights, no tokenizer
    return path


def _llm(model_dir: Path, seed: int) -> LLM:
    return LLM(
        model=str(model_dir), load_format="dummy", seed=seed, device="cpu",
        skip_tokenizer_init=True, max_model_len=64, max_num_seqs=2,
    )  # fmt: skip


def test_dummy_engine_draws_its_weights_and_generates(tmp_path: Path) -> None:
    model_dir = _config_only(tmp_path / "cfg")
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 1, 4, 1, 5]}
    first = _llm(model_dir, seed=7)
    weights = dict(first.llm_engine.runner.model.named_parameters())
    assert weights
    for name, param in weights.items():
        assert torch.isfinite(param).all(), name
        assert param.abs().max() <= DUMMY_RANGE, name
        assert param.std() > DUMMY_RANGE / 10, name  # drawn, not zeros
    tokens = first.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(tokens) == 5 and all(0 <= t < 96 for t in tokens)
    again = _llm(model_dir, seed=7)
    for name, param in again.llm_engine.runner.model.named_parameters():
        assert torch.equal(param, weights[name]), name
    other = dict(_llm(model_dir, seed=8).llm_engine.runner.model.named_parameters())
    assert not all(torch.equal(p, weights[n]) for n, p in other.items())


def test_load_format_is_checked(tmp_path: Path) -> None:
    model_dir = _config_only(tmp_path / "cfg")
    with pytest.raises(ValueError, match="load_format"):
        EngineArgs(model=str(model_dir), load_format="pt").create_engine_config()
    with pytest.raises(ValueError, match="dummy"):
        EngineArgs(
            model=str(model_dir), load_format="dummy", quantization="int8", device="cpu"
        ).create_engine_config()
