"""Batch invariance end to end through the `triton` backend's batch-invariant kernels
(engine/attention/triton_invariant_backend.py, kernels/batch_invariant_*.py): on the CPU in
Triton's interpreter with a tiny fp32 model (the GPU's code path, forced here), natively on a
GPU. A probe's tokens and logprobs are bitwise those it gets alone among neighbours of mixed
lengths with chunked prefill, after a prefix-cache hit and after a preemption."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.attention.triton_invariant_backend import TritonBatchInvariantAttentionBackend
from engine.layers.batch_invariant.triton_linear import TritonInvariantPlan
from engine.layers.linear import Linear
from tests.engine.batch_invariant.harness import first_difference, neighbours, probes, run_probe
from tests.model_utils import make_tiny_llama

VOCAB = 96
PROBES = probes(VOCAB, prompt_len=20)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny"),
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=48,
    )


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(
        str(model_dir),
        device=DEVICE,
        dtype="float32",
        attention_backend="triton",
        batch_invariant=True,
        block_size=16,
        max_model_len=128,
        max_num_seqs=16,
        enforce_eager=True,
        **kwargs,
    )


@pytest.fixture(scope="module")
def alone(model_dir):
    """The greedy probe alone, one whole-prompt prefill, no prefix cache: the reference."""
    llm = _llm(model_dir, enable_chunked_prefill=False, enable_prefix_caching=False)
    runner = llm.llm_engine.executor.runner
    assert isinstance(runner.attn_backend, TritonBatchInvariantAttentionBackend)
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.plan, TritonInvariantPlan) for m in linears)
    assert isinstance(runner.model._logits_plan, TritonInvariantPlan)
    return {kind: run_probe(llm, probe) for kind, probe in PROBES.items()}


@pytest.fixture(scope="module")
def chunked(model_dir):
    """Chunked prefill with a 16-token step budget, prefix caching on."""
    return _llm(model_dir, enable_chunked_prefill=True, max_num_batched_tokens=16)


def _assert_same(expected, actual, what: str) -> None:
    assert actual == expected, f"{what}: {first_difference(expected, actual)}"


@pytest.mark.parametrize("kind", sorted(PROBES))
def test_probe_among_neighbours_chunked(chunked, alone, kind):
    batch = neighbours(5, VOCAB, seed=5, max_prompt=30)
    actual = run_probe(chunked, PROBES[kind], batch, position=2)
    _assert_same(alone[kind], actual, f"{kind} probe among 5 (chunked prefill)")


def test_prefix_cache_hit(chunked, alone):
    probe = PROBES["greedy"]
    run_probe(chunked, probe)
    cached: list[int] = []
    actual = run_probe(chunked, probe, neighbours(3, VOCAB, seed=9, max_prompt=20), 1, cached)
    assert cached[0] >= 16, f"no prefix-cache hit happened ({cached[0]} tokens cached)"
    _assert_same(alone["greedy"], actual, "greedy probe after a prefix-cache hit")


def test_after_preemption(model_dir, alone):
    """4 blocks of 16 tokens for 8 requests that start in one block and grow into a
    second: some are preempted and recomputed, the probe among them."""
    llm = _llm(model_dir, num_gpu_blocks_override=4, max_num_batched_tokens=32)
    batch = neighbours(7, VOCAB, seed=3, max_prompt=14)
    actual = run_probe(llm, PROBES["greedy"], batch, position=3)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0, "no preemption happened"
    _assert_same(alone["greedy"], actual, "greedy probe with preemptions")


def test_a_gpu_gets_the_triton_invariant_backend_by_default():
    """The CUDA branch of `get_attention_backend`: with no backend named, batch_invariant on a
    GPU is the Triton one (built here on the interpreter), on a CPU the native one."""
    from engine.attention.backend import get_attention_backend
    from engine.attention.cpu_invariant_backend import CPUBatchInvariantAttentionBackend
    from engine.native import native_kernels_available

    gpu = get_attention_backend(None, torch.device("cuda"), batch_invariant=True)
    assert isinstance(gpu, TritonBatchInvariantAttentionBackend) and gpu.supports_cuda_graphs
    if native_kernels_available():
        cpu = get_attention_backend(None, torch.device("cpu"), batch_invariant=True)
        assert isinstance(cpu, CPUBatchInvariantAttentionBackend)


def test_weights_without_an_invariant_triton_kernel_are_refused():
    """Quantized layers and mixture-of-experts layers keep batch-variant kernels: refused by
    name when the model is made batch-invariant, never run silently."""
    from torch import nn

    from engine.layers.batch_invariant.triton_linear import make_triton_batch_invariant

    class QuantMethod:
        pass

    layer = Linear(16, 8, bias=False)
    layer.quant_method = QuantMethod()
    with pytest.raises(NotImplementedError, match="QuantMethod weights"):
        make_triton_batch_invariant(nn.Sequential(layer))
    experts = nn.Module()
    experts.expert_param_shards = {}
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        make_triton_batch_invariant(nn.Sequential(experts))
    plain = Linear(16, 8, bias=True).to(DEVICE)
    assert make_triton_batch_invariant(nn.Sequential(plain)) == 1
    x = torch.randn(3, 16, device=DEVICE)
    torch.testing.assert_close(plain(x), x @ plain.weight.T + plain.bias, atol=1e-5, rtol=1e-5)
