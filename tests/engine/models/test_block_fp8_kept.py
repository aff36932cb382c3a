"""Block-scaled FP8 checkpoints kept in FP8 (the CUDA path: engine/loader/model_loader.py
`_block_fp8_checkpoint`), forced on the CPU with $PAGEDSERVE_FP8_COMPUTE=fp8 so the block
GEMM (kernels/fp8_block_gemm.py) runs in Triton's interpreter: the same greedy tokens as
the same checkpoint dequantized at load, and transformers' on the dequantized weights within
DESIGN.md's top-5 rule (DeepSeek-V3's routed experts too: kernels/fused_moe_fp8.py; Qwen3-MoE's:
test_fp8_experts_kept.py); a checkpoint whose fused shards are not whole blocks keeps only the
layers that can, and says which it left dequantized."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.layers.fp8_block_linear import Fp8BlockLinearMethod
from engine.layers.fp8_linear import FP8_COMPUTE_ENV
from tests.engine.block_fp8_checkpoints import make_block_fp8
from tests.engine.models.test_engine_correctness import MAX_TOKENS, REGIMES, make_prompts, run
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.model_utils import make_tiny_llama, make_tiny_model
from tests.triton_utils import import_triton

import_triton()

# Every projection's rows (q 160, k and v 32, gate and up 288) are whole blocks of 16 rows;
# the columns (160, 288) in blocks of 128 leave a ragged last block (masked K steps).
# One layer: the interpreter takes ~50 ms a launch.
LLAMA = dict(hidden_size=160, num_heads=5, num_kv_heads=1, intermediate_size=288, num_layers=1,
             max_position_embeddings=256)  # fmt: skip
# Shards of 96 / 48 / 48 (q|k|v) and 144 (gate|up) rows: not whole blocks of 32 rows.
QWEN3 = dict(hidden_size=80, num_heads=4, num_kv_heads=2, head_dim=24, intermediate_size=144)


def _layers(llm):
    return llm.llm_engine.runner.model.model.layers


def _greedy_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_kept_in_fp8_matches_dequantized_loading(tmp_path, monkeypatch, caplog) -> None:
    source = make_tiny_llama(tmp_path / "source", **LLAMA)
    path, reference_dir = make_block_fp8(source, tmp_path / "fp8", tmp_path / "ref", (16, 128))
    prompts = make_prompts(128)[3:]  # 33 and 8 tokens, two sharing a prefix
    monkeypatch.setenv(FP8_COMPUTE_ENV, "dequantize")
    _, dequantized = run(path, prompts)
    monkeypatch.setenv(FP8_COMPUTE_ENV, "fp8")
    with caplog.at_level(logging.INFO, logger="engine.loader.model_loader"):
        llm, kept = run(path, prompts)
    assert caplog.text.count("7 projections run in FP8") == 1, caplog.text
    layer = _layers(llm)[0]
    for linear in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear.quant_method, Fp8BlockLinearMethod)
        assert linear.weight.dtype == torch.float8_e4m3fn
    assert layer.self_attn.qkv_proj.weight_scale.shape == (14, 2)  # 224 rows, 160 columns
    assert _greedy_ids(kept) == _greedy_ids(dequantized)
    reference = hf_greedy(reference_dir, prompts, MAX_TOKENS)
    assert_close_to_reference(reference, ours_greedy(kept))
    _, chunked = run(path, prompts, **REGIMES["chunked-small-budget"])
    assert _greedy_ids(chunked) == _greedy_ids(kept)


def test_ragged_fused_shards_keep_what_they_can(tmp_path, monkeypatch, caplog) -> None:
    source = make_tiny_model(tmp_path / "source", "Qwen3ForCausalLM", **QWEN3)
    path, _ = make_block_fp8(source, tmp_path / "fp8", tmp_path / "ref", (32, 48))
    prompts = make_prompts(128)[:3]
    monkeypatch.setenv(FP8_COMPUTE_ENV, "dequantize")
    _, dequantized = run(path, prompts)
    monkeypatch.setenv(FP8_COMPUTE_ENV, "fp8")
    with caplog.at_level(logging.INFO, logger="engine.loader.model_loader"):
        llm, kept = run(path, prompts)
    said = [r.getMessage() for r in caplog.records if "Block-scaled FP8" in r.getMessage()]
    assert len(said) == 1 and "4 dequantized" in said[0] and "not whole blocks" in said[0]
    layer = _layers(llm)[0]
    assert layer.self_attn.qkv_proj.quant_method is None
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float32
    assert isinstance(layer.self_attn.o_proj.quant_method, Fp8BlockLinearMethod)
    assert isinstance(layer.mlp.down_proj.quant_method, Fp8BlockLinearMethod)
    assert _greedy_ids(kept) == _greedy_ids(dequantized)


@pytest.mark.parametrize("value", ["dequantize", None])
def test_dequantized_on_the_cpu_unless_forced(tmp_path, monkeypatch, caplog, value) -> None:
    """The auto choice keeps block FP8 on CUDA only (Triton): the CPU dequantizes."""
    source = make_tiny_model(tmp_path / "source", "Qwen3ForCausalLM", **QWEN3)
    path, _ = make_block_fp8(source, tmp_path / "fp8", tmp_path / "ref", (32, 48))
    if value is None:
        monkeypatch.delenv(FP8_COMPUTE_ENV, raising=False)
    else:
        monkeypatch.setenv(FP8_COMPUTE_ENV, value)
    with caplog.at_level(logging.INFO, logger="engine.loader.model_loader"):
        llm, _ = run(path, make_prompts(128)[:1])
    assert caplog.text.count("the weights are dequantized to torch.float32 at load") == 1
    for layer in _layers(llm):
        assert layer.mlp.down_proj.quant_method is None


def test_deepseek_v3_keeps_its_projections_and_experts(tmp_path, monkeypatch, caplog) -> None:
    """MLA's projections, the dense MLP, the shared experts and the routed experts (stacked,
    run by the grouped FP8 GEMM: kernels/fused_moe_fp8.py) in FP8; `kv_b_proj` (split as a
    float matrix by the MLA weights) and the router dequantized."""
    from tests.engine.models.test_block_fp8_checkpoints import _deepseek_block_fp8

    path, reference_dir = _deepseek_block_fp8(tmp_path)
    prompts = make_prompts(128)[4:5]  # one prompt: the routed experts run in the interpreter
    monkeypatch.setenv(FP8_COMPUTE_ENV, "dequantize")
    _, dequantized = run(path, prompts)
    monkeypatch.setenv(FP8_COMPUTE_ENV, "fp8")
    with caplog.at_level(logging.INFO, logger="engine.loader.model_loader"):
        llm, kept = run(path, prompts)
    assert "kv_b_proj: its weight is read as a float matrix" in caplog.text
    layers = _layers(llm)
    attn = layers[0].self_attn
    assert isinstance(attn.o_proj.quant_method, Fp8BlockLinearMethod)
    assert attn.kv_b_proj.quant_method is None and attn.kv_b_proj.weight.dtype == torch.float32
    assert isinstance(layers[0].mlp.down_proj.quant_method, Fp8BlockLinearMethod)
    assert "the experts of 1 MoE layers" in caplog.text
    moe = layers[1].mlp
    assert moe.w13_weight.dtype == moe.w2_weight.dtype == torch.float8_e4m3fn
    assert moe.w13_weight_scale.shape == (4, 2, 2)  # 4 experts: 64 rows, 40 columns in 32 x 32
    assert isinstance(moe.shared_experts.down_proj.quant_method, Fp8BlockLinearMethod)
    assert moe.gate.weight.dtype == torch.float32
    assert _greedy_ids(kept) == _greedy_ids(dequantized)
    reference = hf_greedy(reference_dir, prompts, MAX_TOKENS)
    assert_close_to_reference(reference, ours_greedy(kept))


def test_forcing_without_triton_is_refused(tmp_path, monkeypatch) -> None:
    source = make_tiny_model(tmp_path / "source", "Qwen3ForCausalLM", **QWEN3)
    path, _ = make_block_fp8(source, tmp_path / "fp8", tmp_path / "ref", (32, 48))
    monkeypatch.setenv(FP8_COMPUTE_ENV, "fp8")
    monkeypatch.setattr("engine.loader.model_loader.triton_available", lambda: False)
    with pytest.raises(ValueError, match=rf"\${FP8_COMPUTE_ENV}=fp8: .*Triton is not installed"):
        run(path, make_prompts(128)[:1])
