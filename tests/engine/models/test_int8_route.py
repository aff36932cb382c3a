"""Quantized models with the int8 route forced on every batched step (engine/layers/
quant_select.py; the trial would pick it only where faster) under DESIGN.md's criterion:
a tiny GGUF file of every block type against transformers on the dequantized weights
(chunked prefill, prefix caching, batched decode), and the default model against its own
fp32 route."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.layers.quant_select import QUANT_ROUTE_ENV
from engine.native import native_kernels_available
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy

pytestmark = pytest.mark.skipif(
    not native_kernels_available(), reason="no C compiler: native kernels unavailable"
)

MAX_TOKENS = 12


def _route_or_skip():
    from engine.native.quant_int8 import Int8Isa, int8_isa

    if int8_isa() == Int8Isa.NONE:
        pytest.skip("this CPU has no int8 route (needs AVX2)")


def _int8_parts(llm: LLM) -> int:
    methods = [
        m.quant_method
        for m in llm.llm_engine.runner.model.modules()
        if getattr(m, "quant_method", None) is not None
    ]
    return sum(r is not None for method in methods for r in method.routes)


def _generate(llm, prompts, max_tokens=MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return ours_greedy(outputs)


def test_tiny_gguf_with_the_int8_route_matches_transformers(
    tmp_path, tokenizer_fields, monkeypatch
):
    _route_or_skip()
    from tests.engine.gguf_files import write_tiny_llama_gguf
    from tests.engine.layers.test_quantization import _SCALES

    monkeypatch.setenv(QUANT_ROUTE_ENV, "int8")
    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf", tokenizer_fields, _SCALES)
    llm = LLM(
        model=str(path),
        dtype="float32",
        kv_cache_memory_bytes=8 * 2**20,
        max_num_batched_tokens=16,  # the long prompts are prefilled in chunks
        enable_prefix_caching=True,
    )
    assert _int8_parts(llm) >= 4  # the Q4_0 / Q4_1 / Q8_0 parts of both layers
    shared = [40, 2, 77, 101, 12, 64, 3, 90, 11, 5, 17, 33, 9, 8, 61, 44, 20]
    prompts = [[5, 17, 33, 9], [*shared, 7, 7], [7], [*shared, 30], list(range(3, 40))]
    reference = hf_greedy(llm.llm_engine.get_model_config().model_dir, prompts, MAX_TOKENS)
    assert_close_to_reference(reference, _generate(llm, prompts))
    # again, from a warm prefix cache
    assert_close_to_reference(reference[1:2], _generate(llm, prompts[1:2]))


@pytest.mark.slow
def test_default_model_int8_route_against_its_fp32_route(monkeypatch):
    _route_or_skip()
    monkeypatch.setenv(QUANT_ROUTE_ENV, "fp32")
    fp32 = LLM(kv_cache_memory_bytes=64 * 2**20, max_num_batched_tokens=128)
    tokenizer = fp32.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]
    texts += ["Water boils at", "My favourite colour is", "1, 2, 3, 5, 8,"] * 2
    prompts = [tokenizer(t).input_ids for t in texts]
    reference = _generate(fp32, prompts, 16)
    del fp32
    monkeypatch.setenv(QUANT_ROUTE_ENV, "int8")
    int8 = LLM(kv_cache_memory_bytes=64 * 2**20, max_num_batched_tokens=128)
    assert _int8_parts(int8) > 0
    assert_close_to_reference(reference, _generate(int8, prompts, 16))
