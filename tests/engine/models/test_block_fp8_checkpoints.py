"""Block-scaled FP8 checkpoints (transformers' `quant_method: "fp8"` layout of Qwen3-*-FP8
and DeepSeek-V3, and llm-compressor's compressed-tensors FP8_BLOCK), made here from tiny
random Llama, Qwen3, Qwen3-MoE and DeepSeek-V3 models with sizes that leave ragged edge
blocks, served by the engine (dequantized at load on the CPU; kept in FP8 on CUDA:
test_block_fp8_kept.py) against transformers on the dequantized weights (DESIGN.md's top-5
rule), in every scheduling regime of test_engine_correctness."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.layers.fp8_linear import FP8_COMPUTE_ENV
from tests.engine.block_fp8_checkpoints import make_block_fp8, quantize_blocks
from tests.engine.fp8_checkpoints import (
    compressed_tensors_reference_kwargs,
    make_compressed_tensors_fp8,
)
from tests.engine.models.test_deepseek_v3 import make_tiny_deepseek
from tests.engine.models.test_engine_correctness import (
    MAX_TOKENS,
    REGIMES,
    assert_same_tokens_in_every_regime,
    make_prompts,
    run,
)
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.model_utils import make_tiny_llama, make_tiny_model

# hidden 160 and intermediate 288 in blocks of 128: every projection has a ragged row or
# column block (k_proj's 32 rows are one short block).
LLAMA = dict(hidden_size=160, num_heads=5, num_kv_heads=1, intermediate_size=288,
             max_position_embeddings=256)  # fmt: skip
QWEN3 = dict(hidden_size=80, num_heads=4, num_kv_heads=2, head_dim=24, intermediate_size=144)
QWEN3_MOE = dict(QWEN3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40)


def _llama(root):
    source = make_tiny_llama(root / "source", **LLAMA)
    # one projection left unquantized by the config, as releases do with sensitive layers
    not_converted = ("model.layers.1.mlp.down_proj",)
    path, reference = make_block_fp8(source, root / "fp8", root / "ref", (128, 128), not_converted)
    return path, reference, {}


def _qwen3(root):
    source = make_tiny_model(root / "source", "Qwen3ForCausalLM", **QWEN3)
    path, reference = make_block_fp8(source, root / "fp8", root / "ref", (32, 48))
    return path, reference, {}


def _qwen3_moe(root):
    """Experts (and their router, kept in float as the releases do) of Qwen3-30B-A3B-FP8's
    layout: the experts see dequantized weights, as any other MoE family would."""
    source = make_tiny_model(root / "source", "Qwen3MoeForCausalLM", **QWEN3_MOE)
    path, reference = make_block_fp8(source, root / "fp8", root / "ref", (32, 32))
    return path, reference, {}


def _compressed_tensors(root):
    path = make_compressed_tensors_fp8(root / "fp8", "FP8_BLOCK", **LLAMA)
    return path, path, compressed_tensors_reference_kwargs()


CHECKPOINTS = {
    "llama-fp8-128x128": _llama,
    "qwen3-fp8-32x48": _qwen3,
    "llama-compressed-tensors-fp8-block": _compressed_tensors,
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    """(block FP8 directory, transformers reference directory, its from_pretrained kwargs)."""
    return CHECKPOINTS[request.param](tmp_path_factory.mktemp(request.param))


def _matches_transformers_in_every_regime(
    path, reference_dir, load_kwargs=None, regimes=REGIMES
) -> None:
    prompts = make_prompts(128)
    reference = hf_greedy(reference_dir, prompts, MAX_TOKENS, **(load_kwargs or {}))
    llm, unconstrained = run(path, prompts)
    assert llm.llm_engine.get_model_config().quantization == "fp8"
    assert_close_to_reference(reference, ours_greedy(unconstrained))
    assert_same_tokens_in_every_regime(path, prompts, unconstrained, regimes=regimes)


def test_dequantized_at_load_matches_transformers_in_every_regime(checkpoint) -> None:
    path, reference_dir, load_kwargs = checkpoint
    _matches_transformers_in_every_regime(path, reference_dir, load_kwargs)


def test_qwen3_moe_block_fp8_matches_transformers(tmp_path) -> None:
    """A mixture of experts other than DeepSeek's (whose test runs every regime): the
    dequantized experts against transformers, and with preemption."""
    path, reference, _ = _qwen3_moe(tmp_path)
    regimes = {"preemption-tiny-cache": REGIMES["preemption-tiny-cache"]}
    _matches_transformers_in_every_regime(path, reference, regimes=regimes)


def test_said_once_and_dequantized_on_the_cpu(checkpoint, caplog, monkeypatch) -> None:
    """Dequantized on the CPU by the auto choice (block FP8 stays FP8 on CUDA, through the
    Triton block GEMM: test_block_fp8_kept.py forces that path here)."""
    path = checkpoint[0]
    monkeypatch.delenv(FP8_COMPUTE_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="engine.loader.model_loader"):
        llm = LLM(model=str(path), dtype="float32", max_model_len=64)
    assert caplog.text.count("the weights are dequantized to torch.float32 at load") == 1
    layer = llm.llm_engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == torch.float32 and not hasattr(layer, "weight_scale")


def _deepseek_block_fp8(root):
    """A tiny DeepSeek-V3 in its release's layout: MLA projections, dense MLP, shared and
    routed experts all block FP8 (blocks of 32: q_a_proj's 48 rows, kv_b_proj's 112 and
    kv_lora_rank 24 are ragged), the router kept in float, and a multi-token prediction
    layer past the model's, quantized too, that must be skipped."""
    source = make_tiny_deepseek(
        root / "source", num_layers=2, q_lora_rank=48, n_routed_experts=4, n_group=2,
        topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
    )  # fmt: skip
    config = json.loads((source / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (source / "config.json").write_text(json.dumps(config))
    path, reference = make_block_fp8(source, root / "fp8", root / "ref", (32, 32))
    tensors = load_file(path / "model.safetensors")
    q, scale = quantize_blocks(torch.randn(40, 40), (32, 32))
    tensors["model.layers.2.eh_proj.weight"] = q
    tensors["model.layers.2.eh_proj.weight_scale_inv"] = scale
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path, reference


def test_deepseek_v3_block_fp8_matches_transformers_in_every_regime(tmp_path) -> None:
    path, reference = _deepseek_block_fp8(tmp_path)
    names = load_file(path / "model.safetensors")
    assert names["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"].dtype == torch.float32
    assert names["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    _matches_transformers_in_every_regime(path, reference)
