"""GPT-OSS (`GptOssForCausalLM`) through the whole engine against transformers `generate`, on
tiny random models built with transformers' `GptOssConfig`: attention sinks, sliding-window
layers alternating with full ones (a window of 6, so most prompts cross it), q/k/v/o biases,
the biased, clamped-SwiGLU experts with top-k-then-softmax routing, YaRN rope.

Every CPU attention backend (`cpu`: the C kernels; `torch`) and every scheduling regime of
test_engine_correctness (prefix caching off, chunked prefill with a small budget, preemption
by a tiny cache, no chunking) gives the same tokens. The released MXFP4 expert weights load
to the same model as their dequantized floats; other quantization and GGUF files are refused.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from tests.engine.models.test_engine_correctness import (
    MAX_TOKENS,
    assert_same_tokens_in_every_regime,
    make_prompts,
    run,
)
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.model_utils import make_tiny_model

CONFIG = dict(
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=6,
    swiglu_limit=1.5,  # below the tiny model's activations: the clamp bites
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
        "rope_theta": 150000.0,
    },
)
BACKENDS = ["cpu", "torch"]


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("gpt-oss"), "GptOssForCausalLM", **CONFIG)
    # Sinks of the scores' size (make_tiny_model draws them at 0.15), so they matter.
    state = load_file(str(path / "model.safetensors"))
    for name in state:
        if name.endswith(".sinks"):
            state[name] = state[name] * 10.0
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    return path


@pytest.fixture(scope="module")
def reference(gpt_oss_dir):
    prompts = make_prompts(128)
    return prompts, hf_greedy(gpt_oss_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_transformers_in_every_regime(gpt_oss_dir, reference, backend) -> None:
    prompts, expected = reference
    llm, unconstrained = run(gpt_oss_dir, prompts, attention_backend=backend)
    layer = llm.llm_engine.runner.model.model.layers[0]
    assert layer.self_attn.sinks is not None and layer.self_attn.sliding_window == 6
    assert_close_to_reference(expected, ours_greedy(unconstrained))
    assert_same_tokens_in_every_regime(
        gpt_oss_dir, prompts, unconstrained, attention_backend=backend
    )


def _mxfp4_pair(weight: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks and scales of `weight`'s [E, out, in] shape (scales around 2^-3,
    so the values are of the tiny model's size)."""
    *lead, cols = weight.shape
    blocks = torch.randint(0, 256, (*lead, cols // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(122, 126, (*lead, cols // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_checkpoint_loads_as_its_dequantized_floats(gpt_oss_dir, tmp_path) -> None:
    """The Hub's form: expert `*_blocks` / `*_scales` ([out, in], MXFP4) and a
    quantization_config of mxfp4. The same experts written as transformers' floats (its
    [in, out] layout) are the reference: transformers' tokens, and ours bit for bit."""
    from engine.loader.mxfp4 import dequantize_mxfp4

    gen = torch.Generator().manual_seed(0)
    state = load_file(str(gpt_oss_dir / "model.safetensors"))
    packed, floats = {}, {}
    for name, tensor in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _mxfp4_pair(tensor.transpose(1, 2), gen)
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            floats[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
        else:
            packed[name] = floats[name] = tensor
    config = json.loads((gpt_oss_dir / "config.json").read_text())
    dirs = {}
    for label, tensors in (("floats", floats), ("mxfp4", packed)):
        dirs[label] = tmp_path / label
        dirs[label].mkdir()
        if label == "mxfp4":
            config = {**config, "quantization_config": {"quant_method": "mxfp4"}}
        (dirs[label] / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(dirs[label] / "model.safetensors"), metadata={"format": "pt"})
    prompts = make_prompts(128)[:4]
    _, from_floats = run(dirs["floats"], prompts)
    _, from_mxfp4 = run(dirs["mxfp4"], prompts)
    tokens = [o.outputs[0].token_ids for o in from_mxfp4]
    assert tokens == [o.outputs[0].token_ids for o in from_floats]
    expected = hf_greedy(dirs["floats"], prompts, MAX_TOKENS)
    assert_close_to_reference(expected, ours_greedy(from_mxfp4))


def test_other_quantization_is_refused(gpt_oss_dir, tmp_path) -> None:
    config = json.loads((gpt_oss_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(gpt_oss_dir / "model.safetensors")
    with pytest.raises(NotImplementedError, match=r"quant_method='fp8'.*mxfp4"):
        LLM(model=str(tmp_path), max_model_len=64)


def test_int8_is_refused(gpt_oss_dir) -> None:
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        LLM(model=str(gpt_oss_dir), max_model_len=64, quantization="int8")


def test_gguf_file_is_refused_naming_it(tmp_path) -> None:
    import gguf

    path = tmp_path / "tiny-gpt-oss.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(NotImplementedError, match=r"tiny-gpt-oss\.gguf.*gpt-oss"):
        LLM(model=str(path), max_model_len=64)


def test_mismatched_mxfp4_pair_is_reported() -> None:
    from engine.loader.gpt_oss_weights import gpt_oss_weights

    blocks = torch.zeros(2, 8, 1, 16, dtype=torch.uint8)
    weights = [("model.layers.0.mlp.experts.down_proj_blocks", blocks)]
    with pytest.raises(ValueError, match="down_proj_blocks"):
        list(gpt_oss_weights(weights, torch.float32))


def test_bf16_checkpoint(gpt_oss_dir, tmp_path) -> None:
    """The released non-MXFP4 tensors are bf16: a bf16 checkpoint loads (widened to the fp32
    engine) as transformers reads it."""
    state = load_file(str(gpt_oss_dir / "model.safetensors"))
    save_file(
        {n: t.to(torch.bfloat16) for n, t in state.items()}, str(tmp_path / "model.safetensors")
    )
    config = json.loads((gpt_oss_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    prompts = make_prompts(128)[2:4]
    _, outputs = run(tmp_path, prompts, dtype="float32")
    assert_close_to_reference(hf_greedy(tmp_path, prompts, MAX_TOKENS), ours_greedy(outputs))
