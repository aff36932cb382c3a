"""GGUF files of the other families llama.cpp names (qwen2, qwen3, gemma2, phi3), written
with gguf-py: dequantized (the default) and with the blocks kept quantized
(`quantization="gguf"`), the engine's greedy tokens equal transformers' on the file."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.native import native_kernels_available
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy

PROMPTS = [[5, 17, 33, 9], [40, 2, 77, 101, 12, 64, 3, 90, 11], [7]]
MAX_TOKENS = 10
ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


@pytest.mark.parametrize("quantization", [None, "gguf"])
@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_family_gguf_matches_transformers(tmp_path, tokenizer_fields, architecture, quantization):
    if quantization == "gguf" and not native_kernels_available():
        pytest.skip("the quantized kernels need the native CPU kernels (a C compiler)")
    from tests.engine.gguf_files import write_tiny_family_gguf

    path = write_tiny_family_gguf(tmp_path / f"{architecture}.gguf", architecture, tokenizer_fields)
    llm = LLM(
        model=str(path),
        dtype="float32",  # the reference is transformers in fp32
        kv_cache_memory_bytes=8 * 2**20,
        max_num_batched_tokens=8,
        quantization=quantization,
    )
    config = llm.llm_engine.get_model_config()
    assert config.hf_config.architectures == [ARCHITECTURES[architecture]]
    model = llm.llm_engine.runner.model
    kept = [m for m in model.modules() if getattr(m, "quant_method", None) is not None]
    assert bool(kept) == (quantization == "gguf")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_close_to_reference(
        hf_greedy(config.model_dir, PROMPTS, MAX_TOKENS), ours_greedy(outputs)
    )
