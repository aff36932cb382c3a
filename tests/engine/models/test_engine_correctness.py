"""The engine against transformers `generate`, on tiny random models of every supported
family (Llama shapes, then one or more per other architecture), under every
scheduling regime: batches of uneven prompts, prefix caching on and off, chunked prefill
with a small token budget, and preemption forced by a tiny KV cache."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.model_utils import make_tiny_llama, make_tiny_model

MAX_TOKENS = 24

SHAPES = {
    "gqa-untied": dict(hidden_size=64, num_heads=4, num_kv_heads=2, tie_word_embeddings=False),
    "mha-tied": dict(hidden_size=64, num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
    "mqa-headdim": dict(hidden_size=48, num_heads=6, num_kv_heads=1, head_dim=16, num_layers=3),
    "llama3-rope": dict(
        hidden_size=64,
        num_heads=8,
        num_kv_heads=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
}

# Other families: (architecture, transformers config kwargs), several shapes each.
FAMILY_SHAPES = {
    "qwen2-mha-tied-linear-rope": (
        "Qwen2ForCausalLM",
        dict(
            num_kv_heads=4,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
    ),
    "qwen3-gqa-headdim": ("Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    "qwen3-mqa-tied-bias": (
        "Qwen3ForCausalLM",
        dict(num_kv_heads=1, head_dim=16, tie_word_embeddings=True, attention_bias=True),
    ),
    "phi3-gqa": ("Phi3ForCausalLM", dict(num_heads=8, num_kv_heads=2)),
    # Windows shorter than most prompts: every layer (the KV-cache manager frees blocks
    # behind it), and Qwen2's "layers from max_window_layers on" (the cache keeps all).
    "mistral-window": ("MistralForCausalLM", dict(sliding_window=6, tie_word_embeddings=True)),
    "mistral-window-torch-backend": ("MistralForCausalLM", dict(sliding_window=9)),
    "qwen2-window-layers": (
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, num_layers=3),
    ),
    # Gemma 3: alternating local (window 6) / global layers with their own rope, soft-capped
    # logits, query_pre_attn_scalar, (1 + w) norms, GeGLU.
    "gemma3-alternating-tied": (
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            num_layers=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            sliding_window=6,
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
        ),
    ),
    "gemma3-mqa-untied": (
        "Gemma3ForCausalLM",
        dict(
            num_kv_heads=1,
            head_dim=32,
            num_layers=2,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=9,
            query_pre_attn_scalar=32,
            tie_word_embeddings=False,
        ),
    ),
    # Gemma 2: attention logit soft-capping small enough to bend most scores (the random
    # models' scores reach a few units), on the default (native C) and the torch backends.
    "gemma2-softcap-alternating": (
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            num_layers=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            sliding_window=6,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=3.0,
            tie_word_embeddings=True,
        ),
    ),
    "gemma2-softcap-gqa-torch-backend": (
        "Gemma2ForCausalLM",
        dict(
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=9,
            query_pre_attn_scalar=32,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=30.0,
            tie_word_embeddings=False,
        ),
    ),
    # Mixture of experts, top-2 routing: grouped through the native kernel (default) and
    # the torch reference (torch backend); Qwen3-MoE with and without renormalisation, a
    # dense layer among the sparse ones.
    "mixtral-8x-top2": (
        "MixtralForCausalLM",
        dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, num_layers=2),
    ),
    "mixtral-4x-top2-mha-torch-backend": (
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, num_kv_heads=4),
    ),
    "qwen3moe-renormalized-dense-layer": (
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            num_layers=3,
            head_dim=16,
        ),
    ),
    "qwen3moe-top3-unnormalized": (
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=5,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            norm_topk_prob=False,
            tie_word_embeddings=True,
        ),
    ),
}
# Engine settings of a shape beyond the regimes below (default: the device's backend).
SHAPE_ENGINE_KWARGS = {
    "mistral-window-torch-backend": dict(attention_backend="torch"),
    "gemma2-softcap-gqa-torch-backend": dict(attention_backend="torch"),
    "mixtral-4x-top2-mha-torch-backend": dict(attention_backend="torch"),
}
# A window frees blocks as decodes go, so the cache that forces preemption is shape-specific
# (the scheduler is deterministic: these sizes preempt, checked below).
SHAPE_REGIMES = {
    "mistral-window": {"preemption-tiny-cache": dict(num_gpu_blocks_override=16, block_size=4)}
}

# Regimes that must not change a single token relative to the unconstrained run.
REGIMES = {
    "prefix-caching-off": dict(enable_prefix_caching=False),
    "chunked-small-budget": dict(max_num_batched_tokens=16),
    "preemption-tiny-cache": dict(num_gpu_blocks_override=20, block_size=4),
    "no-chunking": dict(enable_chunked_prefill=False, max_num_batched_tokens=512),
}


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(20)]
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (1, 5, 17, 33, 8)]
    # Two prompts sharing a 20-token prefix (prefix-cache hits), one a prefix of the other.
    prompts += [[*shared, 5, 6, 7], [*shared[:16], 9]]
    return prompts


def run(model_dir, prompts, *, dtype="float32", **engine_kwargs):
    llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=256, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    free = llm.llm_engine.kv_cache_manager.get_num_free_blocks()
    assert free == llm.llm_engine.get_cache_config().num_blocks, "KV blocks leaked"
    return llm, outputs


def assert_same_tokens_in_every_regime(
    model_dir, prompts, unconstrained, regimes=REGIMES, **engine_kwargs
) -> None:
    """Every regime (`REGIMES`: prefix caching off, a small chunk budget, a cache so small
    that requests are preempted, no chunking) gives the unconstrained run's tokens, and the
    preemption regime really preempted."""
    baseline = [o.outputs[0].token_ids for o in unconstrained]
    for name, kwargs in regimes.items():
        llm, outputs = run(model_dir, prompts, **engine_kwargs, **kwargs)
        assert [o.outputs[0].token_ids for o in outputs] == baseline, name
        if name == "preemption-tiny-cache":
            assert llm.llm_engine.scheduler.num_preemptions_total > 0, "no preemption happened"


@pytest.fixture(scope="module", params=[*SHAPES, *FAMILY_SHAPES])
def tiny_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    engine_kwargs = SHAPE_ENGINE_KWARGS.get(request.param, {})
    regimes = {**REGIMES, **SHAPE_REGIMES.get(request.param, {})}
    if request.param in SHAPES:
        path = make_tiny_llama(path, max_position_embeddings=256, **SHAPES[request.param])
        return path, engine_kwargs, regimes
    architecture, kwargs = FAMILY_SHAPES[request.param]
    path = make_tiny_model(path, architecture, max_position_embeddings=256, **kwargs)
    return path, engine_kwargs, regimes


def test_matches_transformers_in_every_regime(tiny_model) -> None:
    tiny_model, engine_kwargs, regimes = tiny_model
    prompts = make_prompts(128)
    reference = hf_greedy(tiny_model, prompts, MAX_TOKENS)
    _, unconstrained = run(tiny_model, prompts, **engine_kwargs)
    assert_close_to_reference(reference, ours_greedy(unconstrained))
    assert_same_tokens_in_every_regime(
        tiny_model, prompts, unconstrained, regimes=regimes, **engine_kwargs
    )


def test_prefix_cache_hits_on_a_repeated_prompt(tmp_path) -> None:
    model_dir = make_tiny_llama(tmp_path, max_position_embeddings=256)
    prompts = make_prompts(128)
    llm, first = run(model_dir, prompts)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    long_prompt = again[3]  # 33 tokens: two full blocks of 16 come from the cache
    assert long_prompt.num_cached_tokens == 32
