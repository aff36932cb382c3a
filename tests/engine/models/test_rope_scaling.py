"""Rope scaling as configured, through the whole engine, against transformers `generate`:
Qwen2 with yarn, Phi-3 with longrope, Llama with dynamic NTK, on tiny random models.

Prompts sit either side of the length-dependent thresholds (longrope's
original_max_position_embeddings, dynamic's max_position_embeddings): short ones whose
generation crosses it, long ones past it from the prefill. Every scheduling regime (prefix
caching off, chunked prefill with a small budget, preemption) must give the same tokens, and
a prefix computed under one scaling must never serve a request under another.
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.model_utils import make_tiny_model

MAX_TOKENS = 16
VOCAB = 128
HALF_HEAD = 8  # head_dim 16: hidden 64 over 4 heads

# name -> (architecture, config kwargs, threshold, max_model_len)
MODELS = {
    "qwen2-yarn": (
        "Qwen2ForCausalLM",
        dict(
            max_position_embeddings=128,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 8.0,
                "rope_theta": 10000.0,
            },
        ),
        32,
        128,
    ),
    "phi3-longrope": (
        "Phi3ForCausalLM",
        dict(
            max_position_embeddings=128,
            original_max_position_embeddings=32,
            rope_parameters={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(HALF_HEAD)],
                "long_factor": [1.0 + 2.0 * i for i in range(HALF_HEAD)],
                "rope_theta": 10000.0,
            },
        ),
        32,
        128,
    ),
    "llama-dynamic": (
        "LlamaForCausalLM",
        dict(max_position_embeddings=48, rope_scaling={"rope_type": "dynamic", "factor": 3.0}),
        48,
        144,
    ),
}
REGIMES = {
    "prefix-caching-off": dict(enable_prefix_caching=False),
    "chunked-small-budget": dict(max_num_batched_tokens=16),
    "preemption-tiny-cache": dict(num_gpu_blocks_override=14, block_size=8),
}


def make_prompts(threshold: int, seed: int = 0) -> list[list[int]]:
    """Within the threshold (one whose generation crosses it), past it from the prefill,
    and two sharing a 24-token prefix either side of it."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    shared = tokens(24)
    return [
        tokens(5),
        tokens(threshold - 6),
        tokens(threshold + 9),
        [*shared, *tokens(threshold - 24)],
        [*shared, *tokens(threshold - 14)],
    ]


def reference(model_dir, prompts):
    """Each prompt from a freshly loaded model: transformers' dynamic rope keeps the largest
    length it has seen between calls."""
    return [hf_greedy(model_dir, [p], MAX_TOKENS)[0] for p in prompts]


def run(model_dir, prompts, max_model_len, **engine_kwargs):
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=max_model_len, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outputs


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory):
    architecture, kwargs, threshold, max_model_len = MODELS[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), architecture, **kwargs)
    return path, threshold, max_model_len


def test_matches_transformers_in_every_regime(model) -> None:
    model_dir, threshold, max_model_len = model
    prompts = make_prompts(threshold)
    _, unconstrained = run(model_dir, prompts, max_model_len)
    assert_close_to_reference(reference(model_dir, prompts), ours_greedy(unconstrained))
    baseline = [o.outputs[0].token_ids for o in unconstrained]
    for name, kwargs in REGIMES.items():
        llm, outputs = run(model_dir, prompts, max_model_len, **kwargs)
        assert [o.outputs[0].token_ids for o in outputs] == baseline, name
        if name == "preemption-tiny-cache":
            assert llm.llm_engine.scheduler.num_preemptions_total > 0, "no preemption happened"


@pytest.mark.parametrize("name", ["phi3-longrope", "llama-dynamic"])
def test_prefix_cache_never_crosses_scaling_regimes(name, tmp_path) -> None:
    """A prompt past the threshold shares its first block with a cached prompt that stayed
    within it: the block is not reused (its keys were rotated under the other scaling), and
    the answer is transformers'. A second prompt past the threshold reuses the first one's blocks
    (longrope: one long regime) or not (dynamic: the theta is the prompt length's own)."""
    architecture, kwargs, threshold, max_model_len = MODELS[name]
    model_dir = make_tiny_model(tmp_path, architecture, **kwargs)
    rng = random.Random(1)
    shared = [rng.randrange(3, VOCAB) for _ in range(32)]
    short = [*shared[:15], 7]  # within, generation included: block 0 cached under it
    long_a = [*shared, *(rng.randrange(3, VOCAB) for _ in range(threshold - 16))]
    long_b = [*long_a[:-3], 9, 10, 11, 12]  # past it too, other length
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=max_model_len, block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs = {}
    for label, prompt in (("short", short), ("long_a", long_a), ("long_b", long_b)):
        (outputs[label],) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert outputs["long_a"].num_cached_tokens == 0, "reused blocks of the short regime"
    expected_b = 0 if name == "llama-dynamic" else 8 * ((len(long_b) - 4) // 8)
    assert outputs["long_b"].num_cached_tokens == expected_b
    ours = ours_greedy([outputs["short"], outputs["long_a"], outputs["long_b"]])
    assert_close_to_reference(reference(model_dir, [short, long_a, long_b]), ours)
