"""Dynamic NTK rope past the original length with the engine's own `max_model_len`: a tiny
random Llama with max_position_embeddings=64 and `rope_scaling {"rope_type": "dynamic",
"factor": 2.0}` serves 128 tokens, as vLLM derives (no `max_model_len` given here). Prompts
on both sides of 64, generations crossing it, against transformers' `generate`, which grows
theta for each sequence length past 64."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.model_utils import make_tiny_llama

MAX_POS, FACTOR, VOCAB = 64, 2.0, 128
# (prompt length, max_tokens): within 64 and crossing it while generating, just below 64
# crossing it at once, past 64 from the prefill, and ending at the derived 128 exactly.
CASES = ((20, 52), (60, 12), (70, 16), (100, 28))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(
        tmp_path_factory.mktemp("dynamic"),
        max_position_embeddings=MAX_POS,
        rope_scaling={"rope_type": "dynamic", "factor": FACTOR},
    )


def test_generates_past_the_original_length_as_transformers(model_dir) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n, _ in CASES]
    llm = LLM(model=str(model_dir), dtype="float32")
    assert llm.llm_engine.config.model_config.max_model_len == int(MAX_POS * FACTOR)
    outputs = []
    for prompt, (_, max_tokens) in zip(prompts, CASES):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == max_tokens, "cut before max_tokens"
        assert out.outputs[0].finish_reason == "length"
        outputs.append(out)
    # transformers' dynamic rope keeps the longest length it has seen between calls: a
    # freshly loaded model for each prompt.
    reference = [hf_greedy(model_dir, [p], n)[0] for p, (_, n) in zip(prompts, CASES)]
    assert_close_to_reference(reference, ours_greedy(outputs))


def test_prompt_past_the_derived_length_is_refused(model_dir) -> None:
    llm = LLM(model=str(model_dir), dtype="float32")
    with pytest.raises(ValueError, match="maximum model length of 128"):
        llm.generate(
            [{"prompt_token_ids": [5] * 129}], SamplingParams(max_tokens=1), use_tqdm=False
        )
