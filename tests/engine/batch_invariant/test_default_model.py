"""Batch invariance on the default model (SmolLM2-135M, GGUF Q4_1 blocks kept quantized:
the native quantized kernels): the probe's tokens and logprobs alone (one whole-prompt
prefill) equal those after a prefix-cache hit and among neighbours that split its prompt
into chunks and, the KV cache being small, get requests preempted; greedy and seeded."""

from __future__ import annotations

import pytest

from engine import LLM
from tests.engine.batch_invariant.harness import first_difference, neighbours, probes, run_probe

VOCAB = 49152
PROBES = probes(VOCAB, prompt_len=36, seed=1)


@pytest.fixture(scope="module")
def llm():
    # 20 blocks of 4 tokens for a probe of 48 and neighbours of up to 40 + 16: preemptions.
    return LLM(
        batch_invariant=True,
        block_size=4,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=20,
        max_model_len=128,
        max_num_seqs=8,
    )


@pytest.mark.parametrize("kind", sorted(PROBES))
def test_default_model_probe(llm, kind):
    probe = PROBES[kind]
    assert llm.reset_prefix_cache()
    preempted = llm.llm_engine.scheduler.num_preemptions_total
    # ids below 128: lengths (and so the schedule) as the tiny models' preemption scenario
    among = run_probe(llm, probe, neighbours(5, 128, seed=11, max_prompt=40), position=2)
    assert llm.llm_engine.scheduler.num_preemptions_total > preempted, "no preemption happened"
    assert llm.reset_prefix_cache()
    cached: list[int] = []
    alone = run_probe(llm, probe, cached=cached)
    assert cached[0] == 0, "the reference run must prefill the whole prompt"
    assert among == alone, f"among 5: {first_difference(alone, among)}"
    again = run_probe(llm, probe, cached=cached)
    assert cached[1] >= 32, f"no prefix-cache hit ({cached[1]} tokens cached)"
    assert again == alone, f"after a hit: {first_difference(alone, again)}"
