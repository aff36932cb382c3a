"""Engines with weights kept quantized (EngineArgs `quantization`) against transformers:
"int8" against transformers given the int8-rounded weights (the quantization's fp32 twin),
"gguf" (the default for a .gguf model on CPU) on tiny GGUF files written here with gguf-py
(every block type) and, in test_default_model.py, on the default model. Plus the argument's
resolution and errors; loading itself is tested in test_gguf_loading.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config.engine_config import EngineArgs
from engine.native import native_kernels_available
from engine.native.quant import QType, quantize_int8
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.model_utils import make_tiny_llama

pytestmark = pytest.mark.skipif(
    not native_kernels_available(), reason="no C compiler: native kernels unavailable"
)

PROMPTS = [[5, 17, 33, 9], [40, 2, 77, 101, 12, 64, 3, 90, 11], [7]]
MAX_TOKENS = 12


def _generate(llm: LLM, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _int8_twin(model_dir: Path, out_dir: Path) -> Path:
    """The checkpoint with every projection replaced by its int8-rounded fp32 twin."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
                module.weight.copy_(quantize_int8(module.weight).dequantize())
    model.save_pretrained(out_dir)
    return out_dir


def test_int8_matches_transformers_on_the_rounded_weights(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "model", hidden_size=96, intermediate_size=160)
    llm = LLM(
        model=str(model_dir),
        quantization="int8",
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=8 * 2**20,
    )
    assert llm.llm_engine.get_model_config().quantization == "int8"
    ours = ours_greedy(_generate(llm, PROMPTS))
    twin = _int8_twin(model_dir, tmp_path / "twin")
    assert_close_to_reference(hf_greedy(twin, PROMPTS, MAX_TOKENS), ours)
    # ... and the rounding is real: the twin is not the original checkpoint.
    original = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    twin_logits_differ = any(
        a.token_ids != b.token_ids or a.top_ids != b.top_ids
        for a, b in zip(original, hf_greedy(twin, PROMPTS, MAX_TOKENS), strict=True)
    )
    assert twin_logits_differ or _weights_differ(model_dir, twin)


def test_int8_quantizes_each_projection_as_it_loads(tmp_path, monkeypatch):
    """No fp32 detour: a layer's projections are int8 (their fp32 weight released) before
    the next layer's tensors are read, so the whole fp32 model is never resident."""
    from engine.api.model_files import load_hf_config
    from engine.attention.cpu_backend import CPUAttentionBackend
    from engine.layers.quantization import projection_layers
    from engine.loader.model_loader import iter_safetensors, load_model

    model_dir = make_tiny_llama(tmp_path / "model", num_layers=3, mlp_bias=True)
    seen: list[tuple[str, int]] = []
    holder: dict[str, torch.nn.Module] = {}

    def watched():
        for name, tensor in iter_safetensors(model_dir):
            if "model" in holder:  # quantized projections so far, as this tensor arrives
                layers = projection_layers(holder["model"])
                seen.append((name, sum(m.quant_method is not None for _, m in layers)))
            yield name, tensor

    from engine.models import decoder

    load = decoder.DecoderForCausalLM.load_weights

    def spying_load(self, weights, on_loaded=None):
        holder["model"] = self
        return load(self, weights, on_loaded)

    monkeypatch.setattr(decoder.DecoderForCausalLM, "load_weights", spying_load)
    model = load_model(
        model_dir,
        load_hf_config(model_dir),
        torch.float32,
        torch.device("cpu"),
        CPUAttentionBackend(),
        weights=watched(),
        quantization="int8",
    )
    layers = projection_layers(model)
    assert len(layers) == 3 * 4 and all(m.quant_method is not None for _, m in layers)
    assert all(m.weight.numel() == 0 for _, m in layers)  # no fp32 copy kept
    for name, done in seen:
        if name.startswith("model.layers.1.") or name.startswith("model.layers.2."):
            assert done >= 4, f"layer 0 still fp32 when {name} was read"
        if name.startswith("model.layers.2."):
            assert done >= 8, f"layer 1 still fp32 when {name} was read"


def _weights_differ(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return any(not torch.equal(wa[k], wb[k]) for k in wa if "proj" in k)


def test_quantization_argument_is_checked(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "model")
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(model=str(model_dir), quantization="fp4").create_engine_config()
    with pytest.raises(ValueError, match=r"quantization='gguf' needs a \.gguf model"):
        EngineArgs(model=str(model_dir), quantization="gguf").create_engine_config()
    with pytest.raises(ValueError, match="dtype float32"):
        EngineArgs(
            model=str(model_dir), quantization="int8", dtype="bfloat16", device="cpu"
        ).create_engine_config()
    for value in ("auto", None, "none"):  # a Hugging Face directory stays unquantized
        config = EngineArgs(model=str(model_dir), quantization=value).create_engine_config()
        assert config.model_config.quantization is None


def test_default_model_quantization_on_cpu():
    """The default ("auto") keeps the default model's GGUF blocks on CPU; None and "none"
    ask for fp32; off CPU-fp32 "auto" falls back to the checkpoint dtype."""
    for value in ("auto", "gguf"):
        config = EngineArgs(device="cpu", quantization=value).create_engine_config()
        assert config.model_config.quantization == "gguf"
        assert config.model_config.gguf_file is not None
    config = EngineArgs(device="cpu").create_engine_config()
    assert config.model_config.quantization == "gguf"
    for value in (None, "none"):
        config = EngineArgs(device="cpu", quantization=value).create_engine_config()
        assert config.model_config.quantization is None
    config = EngineArgs(device="cpu", dtype="bfloat16").create_engine_config()
    assert config.model_config.quantization is None  # the blocks' kernels take fp32


# ---- tiny GGUF files -------------------------------------------------------------------

# Per type: the fp16 block-scale magnitudes that give weights of roughly unit-0.1 size.
_SCALES = {
    QType.Q8_0: 0.002,
    QType.Q4_0: 0.03,
    QType.Q4_1: 0.03,
    QType.Q4_K: 0.004,
    QType.Q6_K: 0.0003,
}


def test_gguf_file_matches_transformers(tmp_path, tokenizer_fields):
    """One file holding every block type (fused q|k|v and gate|up across types too)."""
    from tests.engine.gguf_files import write_tiny_llama_gguf

    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf", tokenizer_fields, _SCALES)
    llm = LLM(
        model=str(path),
        dtype="float32",
        kv_cache_memory_bytes=8 * 2**20,
        max_num_batched_tokens=8,  # the long prompt is prefilled in chunks
    )
    config = llm.llm_engine.get_model_config()
    assert config.quantization == "gguf"  # the default for a .gguf model on CPU
    model = llm.llm_engine.runner.model
    stored = {
        part.qtype
        for module in model.modules()
        if getattr(module, "quant_method", None) is not None
        for part in module.quant_method.parts
    }
    assert stored == set(_SCALES)  # every block type runs in the kernels
    assert model.quantized_logits is not None  # the tied LM head, as stored (Q8_0)
    # No fp32 copy of a projection, the embedding or the head: only the norms have storage.
    assert all(p.numel() <= 256 for p in model.parameters())
    assert all(getattr(m, "packed_weight", None) is None for m in model.modules())
    ours = ours_greedy(_generate(llm, PROMPTS))
    assert_close_to_reference(hf_greedy(config.model_dir, PROMPTS, MAX_TOKENS), ours)
