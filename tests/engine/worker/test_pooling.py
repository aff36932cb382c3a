"""Pooling (`LLM.encode`, `PoolingParams`) of type LAST, the default: the last prompt token's
final normed hidden state against transformers, normalisation, chunked prefill, mixed batches
with generation, prefix caching, preemption, aborts and block accounting. Tiny random Llama
models. MEAN, CLS and `dimensions`: test_pooling_types.py."""

from __future__ import annotations

import random

import pytest
import torch

from engine import (
    LLM,
    EngineArgs,
    LLMEngine,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from tests.model_utils import make_tiny_llama

VOCAB = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-pool"), max_position_embeddings=256)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 7, 16, 40, 75)]


@pytest.fixture(scope="module")
def hf_last_hidden(model_dir, prompts) -> list[torch.Tensor]:
    """transformers' final normed hidden state of each prompt's last token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            model(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0, -1]
            for p in prompts
        ]


def make_llm(model_dir, **kwargs) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", max_model_len=256, max_num_seqs=16, **kwargs)


def encode(llm: LLM, prompts, params=None) -> list[torch.Tensor]:
    outputs = llm.encode([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_no_leak(llm)
    return [o.outputs.data for o in outputs]


def assert_no_leak(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv_cache_manager.get_num_free_blocks() == engine.get_cache_config().num_blocks


def test_pooling_params_defaults_validation_clone() -> None:
    params = PoolingParams()
    assert params.normalize is None  # the engine's PoolerConfig.normalize (True here)
    assert params.dimensions is None
    assert params.output_kind == RequestOutputKind.FINAL_ONLY
    with pytest.raises(ValueError, match="normalize"):
        PoolingParams(normalize="yes")  # type: ignore[arg-type]
    for bad in (0, -3, 2.0, True, "8"):
        with pytest.raises(ValueError, match="dimensions"):
            PoolingParams(dimensions=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="output_kind"):
        PoolingParams(output_kind=RequestOutputKind.DELTA)
    clone = params.clone()
    clone.normalize = False
    assert params.normalize is None


def test_encode_matches_transformers(model_dir, prompts, hf_last_hidden) -> None:
    llm = make_llm(model_dir)
    outputs = llm.encode(
        [{"prompt_token_ids": p} for p in prompts], PoolingParams(normalize=False), use_tqdm=False
    )
    assert [o.request_id for o in outputs] == sorted((o.request_id for o in outputs), key=int), (
        "outputs come back in prompt order"
    )
    for output, prompt, ref in zip(outputs, prompts, hf_last_hidden):
        assert isinstance(output, PoolingRequestOutput)
        assert isinstance(output.outputs, PoolingOutput)
        assert output.finished and output.prompt_token_ids == prompt
        assert output.num_cached_tokens == 0
        data = output.outputs.data
        assert data.dtype == torch.float32 and data.device.type == "cpu"
        assert data.shape == (64,)
        torch.testing.assert_close(data, ref, rtol=1e-4, atol=1e-4)
    assert_no_leak(llm)

    normalized = encode(llm, prompts)  # PoolingParams() normalises by default
    for vector, ref in zip(normalized, hf_last_hidden):
        torch.testing.assert_close(vector.norm(), torch.tensor(1.0), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vector, ref / ref.norm(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "regime",
    [
        dict(max_num_batched_tokens=16),  # long prompts pooled after several chunks
        dict(enable_prefix_caching=False),
        dict(enable_chunked_prefill=False, max_num_batched_tokens=256),
        dict(num_gpu_blocks_override=12, block_size=8),  # preemption
    ],
    ids=["chunked-16", "prefix-caching-off", "no-chunking", "tiny-cache"],
)
def test_pooling_is_the_same_under_every_regime(model_dir, prompts, regime) -> None:
    reference = encode(make_llm(model_dir), prompts)
    llm = make_llm(model_dir, **regime)
    params = [PoolingParams()] * len(prompts)
    outputs = llm.encode([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for output, ref in zip(outputs, reference):
        torch.testing.assert_close(output.outputs.data, ref, rtol=1e-5, atol=1e-5)
    assert_no_leak(llm)


def _mixed_run(llm: LLM, gen_prompts, pool_prompts):
    """Adds generation and pooling requests interleaved; returns (tokens, pooled)."""
    engine = llm.llm_engine
    gen = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    order = []
    for i in range(max(len(gen_prompts), len(pool_prompts))):
        if i < len(gen_prompts):
            engine.add_request(f"g{i}", {"prompt_token_ids": gen_prompts[i]}, gen)
            order.append(f"g{i}")
        if i < len(pool_prompts):
            engine.add_request(f"p{i}", {"prompt_token_ids": pool_prompts[i]}, PoolingParams())
            order.append(f"p{i}")
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert sorted(finals) == sorted(order)
    tokens = [finals[f"g{i}"].outputs[0].token_ids for i in range(len(gen_prompts))]
    pooled = [finals[f"p{i}"].outputs.data for i in range(len(pool_prompts))]
    return tokens, pooled


@pytest.mark.parametrize(
    "regime",
    [{}, dict(max_num_batched_tokens=16), dict(num_gpu_blocks_override=40, block_size=4)],
    ids=["one-budget", "chunked-16", "preempting"],
)
def test_mixed_batches_keep_generation_tokens(model_dir, prompts, regime) -> None:
    gen_prompts = [[*p, 5] for p in prompts[1:]]
    solo = make_llm(model_dir, **regime).generate(
        [{"prompt_token_ids": p} for p in gen_prompts],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    reference_pooled = encode(make_llm(model_dir), prompts)
    llm = make_llm(model_dir, **regime)
    tokens, pooled = _mixed_run(llm, gen_prompts, prompts)
    if "num_gpu_blocks_override" in regime:
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert tokens == [o.outputs[0].token_ids for o in solo]
    for vector, ref in zip(pooled, reference_pooled):
        torch.testing.assert_close(vector, ref, rtol=1e-5, atol=1e-5)
    assert_no_leak(llm)


def test_last_pooling_takes_prefix_cache_hits(model_dir, prompts, hf_last_hidden) -> None:
    """LAST pooling reads only the last token's hidden state, which is always computed, so
    it may take prefix-cache hits (as in vLLM); MEAN and CLS may not (test_pooling_types)."""
    llm = make_llm(model_dir)
    prompt = prompts[-1]  # 75 tokens: 4 full blocks
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2), use_tqdm=False)
    (output,) = llm.encode([{"prompt_token_ids": prompt}], use_tqdm=False)
    assert output.num_cached_tokens == 64
    ref = hf_last_hidden[-1]
    torch.testing.assert_close(output.outputs.data, ref / ref.norm(), rtol=1e-4, atol=1e-4)
    # The blocks stay published after the pooling request: generation still hits them.
    (gen,) = llm.generate(
        [{"prompt_token_ids": [*prompt, 9]}], SamplingParams(max_tokens=2), use_tqdm=False
    )
    assert gen.num_cached_tokens == 64
    assert_no_leak(llm)


def test_llm_engine_pooling_requests_and_aborts(model_dir, prompts) -> None:
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(model_dir),
            dtype="float32",
            max_model_len=256,
            max_num_batched_tokens=16,
        )
    )
    with pytest.raises(TypeError, match="SamplingParams or PoolingParams"):
        engine.add_request("x", {"prompt_token_ids": [3]}, {"normalize": True})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\] = \d+ is not in the vocabulary"):
        engine.add_request("x", {"prompt_token_ids": [VOCAB]}, PoolingParams())
    params = PoolingParams()
    engine.add_request("a", {"prompt_token_ids": prompts[-1]}, params)
    engine.add_request("b", {"prompt_token_ids": prompts[-2]}, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", {"prompt_token_ids": [3]}, params)
    engine.step()  # "a" is partly computed (16-token budget)
    assert engine.kv_cache_manager.get_num_free_blocks() < engine.get_cache_config().num_blocks
    engine.abort_request("a")
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert [o.request_id for o in outputs] == ["b"], "an aborted pooling request has no output"
    (output,) = outputs
    assert output.metrics is not None and output.metrics.finished_time is not None
    assert engine.kv_cache_manager.get_num_free_blocks() == engine.get_cache_config().num_blocks
    assert params.normalize is None  # the caller's params are not changed
