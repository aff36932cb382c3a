"""Batch invariance end to end on tiny random fp32 models (EngineArgs `batch_invariant`):
a probe request's tokens and logprobs are bitwise those it gets alone, in batches of 1..64
neighbours of mixed lengths, with chunked prefill on (a small token budget) and off, after
prefix-cache hits and after a preemption, for greedy and seeded sampling."""

from __future__ import annotations

import pytest

from engine import LLM
from tests.engine.batch_invariant.harness import (
    first_difference,
    neighbours,
    probes,
    run_probe,
)
from tests.model_utils import make_tiny_llama

VOCAB = 128
SHAPES = {
    "gqa-untied": dict(hidden_size=64, num_heads=4, num_kv_heads=2),
    "mqa-tied": dict(hidden_size=48, num_heads=6, num_kv_heads=1, head_dim=16, num_layers=3,
                     tie_word_embeddings=True),
}  # fmt: skip
PROBES = probes(VOCAB)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model_dir(request, tmp_path_factory):
    return make_tiny_llama(
        tmp_path_factory.mktemp(request.param), vocab_size=VOCAB, **SHAPES[request.param]
    )


def _llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 256)
    return LLM(str(model_dir), batch_invariant=True, max_num_seqs=80, **kwargs)


@pytest.fixture(scope="module")
def alone(model_dir):
    """The probes alone, one whole-prompt prefill, no prefix cache: the reference."""
    llm = _llm(model_dir, enable_chunked_prefill=False, enable_prefix_caching=False)
    return {kind: run_probe(llm, probe) for kind, probe in PROBES.items()}


@pytest.fixture(scope="module")
def chunked(model_dir):
    """Chunked prefill with a small step budget (the probe's prompt split over steps and
    mixed with decodes), prefix caching on."""
    return _llm(model_dir, enable_chunked_prefill=True, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def unchunked(model_dir):
    return _llm(
        model_dir,
        enable_chunked_prefill=False,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
    )


def _assert_same(expected, actual, what: str) -> None:
    assert actual == expected, f"{what}: {first_difference(expected, actual)}"


@pytest.mark.parametrize("kind", sorted(PROBES))
@pytest.mark.parametrize("size", [1, 7, 64])
def test_probe_in_a_batch_chunked(chunked, alone, kind, size):
    batch = neighbours(size, VOCAB, seed=size)
    actual = run_probe(chunked, PROBES[kind], batch, position=size // 2)
    _assert_same(alone[kind], actual, f"{kind} probe among {size} (chunked prefill)")


@pytest.mark.parametrize("kind", sorted(PROBES))
@pytest.mark.parametrize("size", [9])
def test_probe_in_a_batch_unchunked(unchunked, alone, kind, size):
    batch = neighbours(size, VOCAB, seed=100 + size)
    actual = run_probe(unchunked, PROBES[kind], batch, position=size)
    _assert_same(alone[kind], actual, f"{kind} probe among {size} (whole prefills)")


@pytest.mark.parametrize("kind", sorted(PROBES))
def test_prefix_cache_hit(chunked, alone, kind):
    """The probe's full blocks already cached (by an earlier run of it, and by a neighbour
    that shares them): the hit must give the bits of a full prefill."""
    probe = PROBES[kind]
    run_probe(chunked, probe)
    sharer = [([*probe.prompt_token_ids[:33], 5, 6, 7], PROBES["greedy"].params)]
    cached: list[int] = []
    batch = sharer + neighbours(6, VOCAB, seed=7)
    actual = run_probe(chunked, probe, batch, position=1, cached=cached)
    assert cached[0] >= 32, f"no prefix-cache hit happened ({cached[0]} tokens cached)"
    _assert_same(alone[kind], actual, f"{kind} probe after a prefix-cache hit")


@pytest.mark.parametrize("kind", sorted(PROBES))
def test_after_preemption(model_dir, alone, kind):
    """A KV cache of 24 blocks for 16 long requests: requests are preempted and recomputed
    (their generated tokens prefilled again), the probe among them."""
    llm = _llm(model_dir, num_gpu_blocks_override=24, max_num_batched_tokens=64)
    batch = [(prompt, params) for prompt, params in neighbours(16, VOCAB, seed=3, max_prompt=60)]
    actual = run_probe(llm, PROBES[kind], batch, position=8)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0, "no preemption happened"
    _assert_same(alone[kind], actual, f"{kind} probe with preemptions")
