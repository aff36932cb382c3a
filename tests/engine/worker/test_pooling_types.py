"""MEAN and CLS pooling (`PoolerConfig.pooling_type`) and Matryoshka `dimensions`, against
transformers' final normed hidden states (`hidden_states[-1]`, as the LAST tests use): one
batch of prompts of different lengths, chunked prefill, preemption, prefix caching with a
shared prefix, aborts; the accumulators and KV blocks are all given back. Tiny random Llama
models. PoolerConfig resolution from a sentence-transformers directory: test_pooler_config.py.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine import LLM, EngineArgs, LLMEngine, PoolingParams, SamplingParams
from tests.model_utils import make_tiny_llama

VOCAB = 128
HIDDEN = 64
MATRYOSHKA_DIMENSIONS = [16, 32, 64]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-pool-types"), max_position_embeddings=256)


@pytest.fixture(scope="module")
def matryoshka_dir(tmp_path_factory):
    """The same weights, with `matryoshka_dimensions` in config.json."""
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny-matryoshka"), max_position_embeddings=256)
    config = json.loads((path / "config.json").read_text())
    config["matryoshka_dimensions"] = MATRYOSHKA_DIMENSIONS
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 7, 16, 40, 75, 33)]


@pytest.fixture(scope="module")
def hf_hidden(model_dir):
    """prompt -> transformers' final normed hidden states of all its tokens [len, hidden]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def run(prompt: list[int]) -> torch.Tensor:
        return model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]

    return run


def reference(hf_hidden, prompt, pooling_type, dimensions=None, normalize=True):
    hidden = hf_hidden(prompt)
    vector = hidden.mean(0) if pooling_type == "MEAN" else hidden[0]
    if dimensions is not None:
        vector = vector[:dimensions]
    return vector / vector.norm() if normalize else vector


def make_llm(model_dir, pooling_type, **kwargs) -> LLM:
    return LLM(
        model=str(model_dir),
        dtype="float32",  # the reference is transformers in fp32
        max_model_len=256,
        max_num_seqs=16,
        pooler_config={"pooling_type": pooling_type},
        **kwargs,
    )


def assert_no_leak(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.get_num_free_blocks() == engine.get_cache_config().num_blocks
    assert len(engine.runner.pooler) == 0, "every pooling accumulator is freed"


def encode(llm: LLM, prompts, params=None):
    outputs = llm.encode([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_no_leak(llm)
    return outputs


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
@pytest.mark.parametrize("normalize", [True, False])
def test_matches_transformers_in_one_batch(model_dir, prompts, hf_hidden, pooling_type, normalize):
    llm = make_llm(model_dir, pooling_type)
    assert llm.llm_engine.get_engine_config().pooler_config.pooling_type == pooling_type
    outputs = encode(llm, prompts, PoolingParams(normalize=normalize))
    for output, prompt in zip(outputs, prompts):
        ref = reference(hf_hidden, prompt, pooling_type, normalize=normalize)
        assert output.outputs.data.shape == (HIDDEN,)
        torch.testing.assert_close(output.outputs.data, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
@pytest.mark.parametrize(
    "regime",
    [
        dict(max_num_batched_tokens=7),  # every long prompt over many unaligned chunks
        dict(max_num_batched_tokens=16, block_size=8),
        dict(enable_chunked_prefill=False, max_num_batched_tokens=256),
        dict(num_gpu_blocks_override=12, block_size=8, max_num_batched_tokens=32),  # preempts
    ],
    ids=["chunked-7", "chunked-16", "no-chunking", "tiny-cache"],
)
def test_every_regime_matches_transformers(model_dir, prompts, hf_hidden, pooling_type, regime):
    llm = make_llm(model_dir, pooling_type, **regime)
    outputs = encode(llm, prompts)
    for output, prompt in zip(outputs, prompts):
        ref = reference(hf_hidden, prompt, pooling_type)
        torch.testing.assert_close(output.outputs.data, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_prefix_cache_hits_are_not_taken(model_dir, hf_hidden, pooling_type):
    """Prompts sharing a 48-token prefix whose blocks are cached: MEAN/CLS still compute
    every token (num_cached_tokens 0) and match transformers; generation still hits."""
    rng = random.Random(2)
    prefix = [rng.randrange(3, VOCAB) for _ in range(48)]
    shared = [[*prefix, *(rng.randrange(3, VOCAB) for _ in range(n))] for n in (1, 9, 30)]
    llm = make_llm(model_dir, pooling_type, max_num_batched_tokens=20)
    llm.generate([{"prompt_token_ids": prefix}], SamplingParams(max_tokens=1), use_tqdm=False)
    outputs = encode(llm, [prefix, *shared])
    for output, prompt in zip(outputs, [prefix, *shared]):
        assert output.num_cached_tokens == 0
        ref = reference(hf_hidden, prompt, pooling_type)
        torch.testing.assert_close(output.outputs.data, ref, rtol=1e-4, atol=1e-4)
    (gen,) = llm.generate(
        [{"prompt_token_ids": shared[-1]}], SamplingParams(max_tokens=1), use_tqdm=False
    )
    assert gen.num_cached_tokens >= 48  # the cached prefix is still there to hit
    assert_no_leak(llm)


def test_mixed_with_generation_and_preemption(model_dir, prompts, hf_hidden):
    """MEAN pooling beside generation in a cache small enough to preempt: pooled vectors
    still match transformers and generated tokens match a run without pooling."""
    regime = dict(num_gpu_blocks_override=40, block_size=4, max_num_batched_tokens=24)
    gen = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    gen_prompts = [[*p, 5] for p in prompts[1:]]
    solo = make_llm(model_dir, "MEAN", **regime).generate(
        [{"prompt_token_ids": p} for p in gen_prompts], gen, use_tqdm=False
    )
    llm = make_llm(model_dir, "MEAN", **regime)
    engine = llm.llm_engine
    for i, (g, p) in enumerate(zip(gen_prompts, prompts)):
        engine.add_request(f"g{i}", {"prompt_token_ids": g}, gen)
        engine.add_request(f"p{i}", {"prompt_token_ids": p}, PoolingParams())
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.num_preemptions_total > 0
    for i, expected in enumerate(solo):
        assert finals[f"g{i}"].outputs[0].token_ids == expected.outputs[0].token_ids
    for i, prompt in enumerate(prompts[: len(gen_prompts)]):
        ref = reference(hf_hidden, prompt, "MEAN")
        torch.testing.assert_close(finals[f"p{i}"].outputs.data, ref, rtol=1e-4, atol=1e-4)
    assert_no_leak(llm)


def test_aborts_free_accumulators_and_blocks(model_dir, prompts, hf_hidden):
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(model_dir),
            dtype="float32",
            max_model_len=256,
            max_num_batched_tokens=16,
            pooler_config={"pooling_type": "MEAN"},
        )
    )
    engine.add_request("a", {"prompt_token_ids": prompts[4]}, PoolingParams())
    engine.step()  # "a" has one 16-token chunk accumulated
    assert len(engine.runner.pooler) == 1
    engine.abort_request("a")
    # The same id again, from scratch: its old accumulator must not leak into it.
    engine.add_request("a", {"prompt_token_ids": prompts[3]}, PoolingParams())
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    (output,) = outputs
    ref = reference(hf_hidden, prompts[3], "MEAN")
    torch.testing.assert_close(output.outputs.data, ref, rtol=1e-4, atol=1e-4)
    assert len(engine.runner.pooler) == 0
    assert engine.kv_cache_manager.get_num_free_blocks() == engine.get_cache_config().num_blocks


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("dimensions", [16, 32])
def test_dimensions_truncate_then_normalise(
    matryoshka_dir, prompts, hf_hidden, pooling_type, dimensions
):
    llm = make_llm(matryoshka_dir, pooling_type, max_num_batched_tokens=16)
    params = [PoolingParams(dimensions=dimensions), PoolingParams()]  # per request
    outputs = encode(llm, prompts[3:5], params)
    short, full = (o.outputs.data for o in outputs)
    assert short.shape == (dimensions,) and full.shape == (HIDDEN,)
    torch.testing.assert_close(short.norm(), torch.tensor(1.0), rtol=1e-5, atol=1e-5)
    hidden = hf_hidden(prompts[3])
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
    vector = vector[:dimensions]
    torch.testing.assert_close(short, vector / vector.norm(), rtol=1e-4, atol=1e-4)
    (raw,) = encode(llm, prompts[3:4], PoolingParams(dimensions=dimensions, normalize=False))
    torch.testing.assert_close(raw.outputs.data, vector, rtol=1e-4, atol=1e-4)


def test_bad_dimensions_are_refused(model_dir, matryoshka_dir, prompts):
    llm = make_llm(matryoshka_dir, "MEAN")
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": prompts[2]}
    with pytest.raises(ValueError, match="dimensions=128 exceeds the model's hidden size"):
        engine.add_request("x", prompt, PoolingParams(dimensions=128))
    with pytest.raises(ValueError, match=r"dimensions=24: .* only the Matryoshka dimensions"):
        engine.add_request("x", prompt, PoolingParams(dimensions=24))
    with pytest.raises(ValueError, match="dimensions must be a positive int"):
        engine.add_request("x", prompt, PoolingParams(dimensions=0))
    assert_no_leak(llm)

    plain = make_llm(model_dir, "MEAN")
    with pytest.raises(ValueError, match=r"dimensions: model .* does not support Matryoshka"):
        plain.encode([prompt], PoolingParams(dimensions=32), use_tqdm=False)
    assert_no_leak(plain)


def test_is_matryoshka_allows_any_size_up_to_hidden(tmp_path, prompts, hf_hidden):
    path = make_tiny_llama(tmp_path / "m", max_position_embeddings=256)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    llm = make_llm(path, "CLS")
    (output,) = encode(llm, prompts[2:3], PoolingParams(dimensions=24))
    ref = reference(hf_hidden, prompts[2], "CLS", dimensions=24)
    torch.testing.assert_close(output.outputs.data, ref, rtol=1e-4, atol=1e-4)
