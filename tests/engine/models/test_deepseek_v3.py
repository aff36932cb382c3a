"""DeepSeek-V3 (multi-head latent attention, DeepSeek MoE) on tiny random models built with
transformers' `DeepseekV3Config`: token for token against transformers `generate` with
prefix caching on and off, chunked prefill and preemption; the latent KV cache's size; the
Hub's and transformers 5's tensor names; and what is refused (quantized checkpoints other
than block FP8, deepseek2 GGUF files)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from tests.engine.models.test_engine_correctness import (
    assert_same_tokens_in_every_regime,
    make_prompts,
    run,
)
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.model_utils import make_tiny_model

MAX_TOKENS = 24

# name -> (DeepseekV3Config kwargs, engine kwargs)
SHAPES = {
    # q low-rank projection, interleaved rope, 8 experts in 4 groups of which 2 are kept,
    # one dense layer before two MoE layers; the default backend (MLA layers in torch).
    "q-lora-interleaved-groups": (
        dict(
            num_layers=3,
            q_lora_rank=48,
            rope_interleave=True,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            n_shared_experts=1,
        ),
        {},
    ),
    # No q low-rank projection, rope not interleaved, YaRN with DeepSeek's mscale on the
    # softmax scale, unnormalized top-3 over 1 of 3 groups, two shared experts, torch backend.
    "q-full-yarn-mscale-torch-backend": (
        dict(
            num_layers=2,
            q_lora_rank=None,
            rope_interleave=False,
            n_routed_experts=6,
            n_group=3,
            topk_group=1,
            num_experts_per_tok=2,
            n_shared_experts=2,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                # x 4 = max_position_embeddings (256), as in DeepSeek's own configs: the
                # engine's max_model_len is original x factor (vLLM's derivation).
                "original_max_position_embeddings": 64,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "rope_theta": 10000.0,
            },
        ),
        dict(attention_backend="torch"),
    ),
}
KV_LORA_RANK, ROPE_DIM = 24, 8


def make_tiny_deepseek(path, **overrides):
    """A random DeepseekV3ForCausalLM with random expert-score correction biases (a buffer
    that the shared helper leaves at zero)."""
    kwargs = dict(
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=96,
        moe_intermediate_size=32,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_DIM,
        qk_nope_head_dim=16,
        v_head_dim=12,
        first_k_dense_replace=1,
        **overrides,
    )
    path = make_tiny_model(path, "DeepseekV3ForCausalLM", **kwargs)
    file = path / "model.safetensors"
    tensors = load_file(file)
    generator = torch.Generator().manual_seed(1)
    for name, tensor in tensors.items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.randn(tensor.shape, generator=generator) * 0.5
    save_file(tensors, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=list(SHAPES))
def tiny_deepseek(request, tmp_path_factory):
    config_kwargs, engine_kwargs = SHAPES[request.param]
    path = make_tiny_deepseek(tmp_path_factory.mktemp(request.param), **config_kwargs)
    return path, engine_kwargs


def test_matches_transformers_in_every_regime(tiny_deepseek) -> None:
    model_dir, engine_kwargs = tiny_deepseek
    prompts = make_prompts(128)
    reference = hf_greedy(model_dir, prompts, MAX_TOKENS)
    llm, unconstrained = run(model_dir, prompts, **engine_kwargs)
    assert_close_to_reference(reference, ours_greedy(unconstrained))
    baseline = [o.outputs[0].token_ids for o in unconstrained]
    # The same prompts again: prefills on top of cached latent blocks.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == baseline
    assert again[3].num_cached_tokens == 32  # 33 tokens: two full blocks of 16 hit
    assert_same_tokens_in_every_regime(model_dir, prompts, unconstrained, **engine_kwargs)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return make_tiny_deepseek(
        tmp_path_factory.mktemp("ds-small"), num_layers=2, n_group=2, topk_group=1
    )


def test_kv_cache_holds_the_latent(small_model) -> None:
    """Each layer's cache is [blocks, block_size, kv_lora_rank + rope]; a block's bytes are
    that entry per token and layer, in the cache dtype."""
    prompts = make_prompts(128)[:4]
    reference = hf_greedy(small_model, prompts, 8)
    for dtype, size in (("auto", 4), ("bfloat16", 2)):
        llm = LLM(
            model=str(small_model),
            dtype="float32",
            max_model_len=128,
            block_size=8,
            kv_cache_dtype=dtype,
        )
        runner = llm.llm_engine.runner
        entry = KV_LORA_RANK + ROPE_DIM
        assert [tuple(c.shape[1:]) for c in runner.kv_caches] == [(8, entry)] * 2
        assert runner.kv_bytes_per_block == 8 * entry * size * 2
        # Full keys and values of 4 heads x (16 + 8) would be 2 * 4 * 24 = 192 per token.
        assert entry * 6 == 2 * 4 * (16 + 8)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_close_to_reference(reference, ours_greedy(outputs))


def _stacked_checkpoint(source, dest, num_layers: int) -> None:
    """`source`'s weights under transformers 5's stacked expert names, plus a multi-token
    prediction layer past the model's (as DeepSeek's release has), which must be skipped."""
    dest.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (dest / "config.json").write_text(json.dumps(config))
    tensors = load_file(source / "model.safetensors")
    out = {}
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        names = sorted(n for n in tensors if n.startswith(prefix))
        if not names:
            continue
        num_experts = len(names) // 3
        gate_up = [
            torch.cat(
                (tensors[f"{prefix}{e}.gate_proj.weight"], tensors[f"{prefix}{e}.up_proj.weight"])
            )
            for e in range(num_experts)
        ]
        out[f"{prefix}gate_up_proj"] = torch.stack(gate_up)
        down = [tensors[f"{prefix}{e}.down_proj.weight"] for e in range(num_experts)]
        out[f"{prefix}down_proj"] = torch.stack(down)
        for name in names:
            del tensors[name]
    out.update(tensors)
    out[f"model.layers.{num_layers}.eh_proj.weight"] = torch.zeros(4, 4)
    out[f"model.layers.{num_layers}.self_attn.kv_b_proj.weight"] = torch.zeros(4, 4)
    save_file(out, dest / "model.safetensors", metadata={"format": "pt"})


def test_stacked_expert_names_and_mtp_layers_load(small_model, tmp_path) -> None:
    stacked = tmp_path / "stacked"
    _stacked_checkpoint(small_model, stacked, num_layers=2)
    prompts = make_prompts(128)[:3]
    _, expected = run(small_model, prompts)
    _, got = run(stacked, prompts)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_quantized_checkpoint_other_than_block_fp8_is_refused(small_model, tmp_path) -> None:
    """DeepSeek's block FP8 release loads (test_block_fp8_checkpoints.py); per-channel FP8
    (and INT4) is refused naming the format: untested with MLA."""
    from tests.engine.config.test_checkpoint_quantization import CT_DYNAMIC

    quantized = tmp_path / "fp8"
    quantized.mkdir()
    config = json.loads((small_model / "config.json").read_text())
    config["quantization_config"] = CT_DYNAMIC
    (quantized / "config.json").write_text(json.dumps(config))
    (quantized / "model.safetensors").symlink_to(small_model / "model.safetensors")
    message = r"quant_method='compressed-tensors': fp8 per channel.*only block-scaled FP8"
    with pytest.raises(NotImplementedError, match=message):
        LLM(model=str(quantized), max_model_len=64)


def test_engine_int8_quantization_is_refused(small_model) -> None:
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        LLM(model=str(small_model), max_model_len=64, quantization="int8")


def test_deepseek2_gguf_is_refused_naming_the_file(tmp_path) -> None:
    import gguf

    path = tmp_path / "tiny-deepseek2.gguf"
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_block_count(1)
    writer.add_tensor("output_norm.weight", torch.ones(8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(NotImplementedError, match=rf"{path.name}.*'deepseek2'.*safetensors"):
        LLM(model=str(path), max_model_len=64)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_other_backends_run_mla_layers_in_torch(small_model, backend, caplog) -> None:
    """The cpu and triton backends hand MLA layers the torch implementation, say so once,
    and keep the tokens (the triton backend runs in Triton's interpreter without a GPU)."""
    from engine.native import native_kernels_available

    if backend == "cpu" and not native_kernels_available():
        pytest.skip("the cpu backend needs the native CPU kernels (a C compiler)")
    prompts = make_prompts(128)[2:5]
    with caplog.at_level(logging.INFO, logger="engine.attention.backend"):
        _, outputs = run(small_model, prompts, attention_backend=backend)
    message = f"Attention backend {backend!r} has no multi-head latent attention kernels"
    assert caplog.text.count(message) == 1
    assert_close_to_reference(hf_greedy(small_model, prompts, MAX_TOKENS), ours_greedy(outputs))
