"""`kv_cache_dtype="fp8"`: the setting (the Triton backend only), the cache it allocates
(1 byte an element: twice the blocks of a 16-bit cache), the checkpoint's per-layer scales,
and the engine's tokens through the Triton kernels in the interpreter.

The tokens are checked against the same engine with an fp32 cache into which each step's
keys and values are written already quantized and dequantized (`(x / scale).clamp(-448,
448).to(e4m3).float() * scale`): both attend over the same numbers, in fp32, so the greedy
tokens must be equal, not merely close. (Against the fp32-cache engine alone, E4M3's 2^-4
rounding moves the logits enough that only DESIGN.md's top-5 rule could be asked, which would
not catch a wrong scale.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kernels
from engine import LLM, EngineArgs, LLMEngine, SamplingParams
from tests.engine.fp8_checkpoints import make_modelopt_fp8
from tests.model_utils import make_tiny_llama

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(
        tmp_path_factory.mktemp("kv8") / "m", hidden_size=64, num_heads=4, num_kv_heads=2
    )


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3"])
def test_fp8_resolves_with_the_triton_backend(tiny, value):
    config = EngineArgs(
        model=str(tiny), dtype="float32", kv_cache_dtype=value, attention_backend="triton"
    ).create_engine_config()
    assert config.cache_config.cache_dtype == "float8_e4m3fn"


@pytest.mark.parametrize("backend", [None, "torch", "cpu"])
def test_fp8_is_refused_elsewhere_naming_the_backend(tiny, backend):
    args = EngineArgs(
        model=str(tiny), device="cpu", kv_cache_dtype="fp8", attention_backend=backend
    )
    with pytest.raises(ValueError, match=rf"kv_cache_dtype='fp8'.*'{backend or 'cpu'}' backend"):
        args.create_engine_config()


def test_fp8_is_refused_with_batch_invariant(tiny):
    args = EngineArgs(
        model=str(tiny),
        dtype="float32",
        kv_cache_dtype="fp8",
        attention_backend="triton",
        batch_invariant=True,
    )
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8'.*batch_invariant"):
        args.create_engine_config()


def test_an_fp8_cache_holds_twice_the_blocks_of_a_16_bit_one(tiny):
    budget = 1 << 21
    runners = {
        dtype: LLMEngine.from_engine_args(
            EngineArgs(
                model=str(tiny),
                dtype="float32",
                attention_backend="triton",
                kv_cache_memory_bytes=budget,
                kv_cache_dtype=dtype,
            )
        ).runner
        for dtype in ("bfloat16", "fp8")
    }
    narrow, wide = runners["fp8"], runners["bfloat16"]
    assert all(c.dtype == FP8 for c in narrow.kv_caches)
    assert narrow.kv_bytes_per_block * 2 == wide.kv_bytes_per_block
    assert narrow.num_blocks == 2 * wide.num_blocks


def test_checkpoint_scales_reach_the_attention_layers(tmp_path):
    path, _ = make_modelopt_fp8(
        tmp_path / "fp8", tmp_path / "ref", hidden_size=64, num_heads=4, num_kv_heads=2
    )
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory_bytes=1 << 21)
    layers = llm.llm_engine.runner.model.model.layers
    assert [(la.self_attn.k_scale, la.self_attn.v_scale) for la in layers] == [(0.5, 0.25)] * len(
        layers
    )


def _attention_layers(llm: LLM) -> list:
    return [layer.self_attn for layer in llm.llm_engine.runner.model.model.layers]


def test_tokens_equal_those_over_the_dequantized_cache(tiny, monkeypatch):
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 120 for j in range(n)]} for i, n in
               enumerate([5, 19])]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    common = dict(
        model=str(tiny),
        dtype="float32",
        attention_backend="triton",
        block_size=16,
        max_num_batched_tokens=16,  # the 19-token prompt in two chunks
        kv_cache_memory_bytes=1 << 21,
    )
    scales = [(0.05, 0.02), (0.5, 0.01)]  # per layer (the tiny model has 2)

    fp8 = LLM(kv_cache_dtype="fp8", **common)
    for attn, (k, v) in zip(_attention_layers(fp8), scales, strict=True):
        attn.k_scale, attn.v_scale = k, v
    got = fp8.generate(prompts, params, use_tqdm=False)

    real_write = kernels.rotary_write_kv_cache
    seen = set()

    def write_dequantized(qk, value, cos, sin, kv_cache, slots, num_heads, *, k_scale, v_scale):
        real_write(qk, value, cos, sin, kv_cache, slots, num_heads)  # fp32 cache
        seen.add((k_scale, v_scale))
        used = slots[slots >= 0]
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        for i, scale in ((0, k_scale), (1, v_scale)):
            rows = flat[i, used]
            flat[i, used] = (rows / scale).clamp(-448, 448).to(FP8).float() * scale

    monkeypatch.setattr(kernels, "rotary_write_kv_cache", write_dequantized)
    ref = LLM(**common)
    for attn, (k, v) in zip(_attention_layers(ref), scales, strict=True):
        attn.k_scale, attn.v_scale = k, v
    seen.clear()  # the start-up's warm-up steps ran with 1.0
    want = ref.generate(prompts, params, use_tqdm=False)
    assert seen == set(scales)  # each layer's scales reach its write
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
