"""A bf16 engine on CPU (what `dtype="auto"` picks where bf16 is native) against transformers
in bf16, under DESIGN.md's criterion: greedy tokens equal, or each side's token within the
other's top-5 at the first divergence. Runs on every CPU (slower where bf16 is emulated, so
the model is tiny); bf16 steps bypass the fp32-only C paths (the whole-step decode and the
greedy screen), which this also covers: batches of one decode row and greedy rows."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.model_utils import make_tiny_model

MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen2ForCausalLM"])
def tiny(request, tmp_path_factory):
    """Two families: llama, and Qwen2 (q/k/v biases through the bf16 linear plans)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("bf16") / "m", request.param, hidden_size=64, num_layers=2
    )


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, vocab_size) for _ in range(n)] for n in (5, 23, 40, 17)]


def test_bf16_engine_matches_transformers_bf16(tiny):
    llm = LLM(
        model=str(tiny),
        dtype="bfloat16",
        max_num_batched_tokens=32,
        seed=0,
        block_size=4,
        num_gpu_blocks_override=24,  # fewer blocks than four prompts need at once: preemption
    )
    runner = llm.llm_engine.runner
    assert runner.dtype == torch.bfloat16
    assert all(cache.dtype == torch.bfloat16 for cache in runner.kv_caches)
    # Every projection runs on a plan timed among the bf16 methods (linear_select.py).
    planned = [m.plan for m in runner.model.modules() if getattr(m, "plan", None) is not None]
    assert planned and all(set(p.methods) <= {"onednn", "torch"} for p in planned)
    prompts = _prompts(llm.llm_engine.get_model_config().vocab_size)
    reference = hf_greedy(tiny, prompts, MAX_TOKENS, dtype=torch.bfloat16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    # All at once (chunked prefill: 85 prompt tokens over 32-token steps), then one alone
    # (batch-1 decode, the whole-step path's shape) from a warm prefix cache.
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_close_to_reference(reference, ours_greedy(together))
    assert llm.llm_engine.scheduler.num_preemptions_total > 0, "no preemption happened"
    alone = llm.generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False)
    assert_close_to_reference(reference[2:3], ours_greedy(alone))
    # Greedy without logprobs: the rows the fp32 greedy screen would take.
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = llm.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)
    for ref, out in zip(ours_greedy(together), tokens):
        assert list(out.outputs[0].token_ids) == ref.token_ids
