"""The W8A8 prefill route of block-scaled FP8 projections (engine/layers/fp8_block_linear.py:
kernels/fp8_block_w8a8.py after kernels/fp8_group_quant.py), as a GPU with FP8 tensor cores
takes it, forced on the CPU: $PAGEDSERVE_FP8_COMPUTE=fp8 keeps block FP8 (the kernels in
Triton's interpreter), the device is said to have FP8 tensor cores, and the threshold is 0
rows, so every step of every projection runs W8A8. Against transformers on the dequantized
weights within DESIGN.md's top-5 rule: the activations are quantized (half an E4M3 step per
value), so the greedy tokens need not be the dequantized load's bit for bit (on these tiny
random models, whose logits are near ties, they are not); a Llama in blocks of 16 x 128
(ragged last column block), a Qwen3 in blocks of 16 x 32 (K = 80: a ragged K step), and a
Qwen3-MoE in blocks of 64 x 64 whose experts run the W8A8 grouped GEMM
(kernels/fused_moe_fp8_w8a8.py; the busiest expert's threshold also 0)."""

from __future__ import annotations

import logging

import pytest
import torch

import kernels.fp8_block_w8a8
import kernels.fused_moe_fp8_w8a8
from engine.layers.fp8_block_linear import Fp8BlockLinearMethod
from engine.layers.fp8_linear import FP8_COMPUTE_ENV
from tests.engine.block_fp8_checkpoints import make_block_fp8
from tests.engine.models.test_block_fp8_kept import LLAMA
from tests.engine.models.test_engine_correctness import MAX_TOKENS, make_prompts, run
from tests.engine.models.test_fp8_experts_kept import QWEN3_MOE
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.model_utils import make_tiny_llama, make_tiny_model
from tests.triton_utils import import_triton

import_triton()

# Every fused shard's rows (96 / 48 / 48, 144) are whole blocks of 16 rows.
QWEN3 = dict(hidden_size=80, num_heads=4, num_kv_heads=2, head_dim=24, intermediate_size=144,
             num_layers=1)  # fmt: skip


def _force_w8a8(monkeypatch) -> tuple[list[int], list[int]]:
    """Routes every row count to the W8A8 GEMMs; returns the row counts the dense one and
    the experts' one are called with."""
    monkeypatch.setenv(FP8_COMPUTE_ENV, "fp8")
    monkeypatch.setattr("engine.layers.fp8_block_linear.fp8_tensor_cores", lambda device: True)
    monkeypatch.setattr("engine.layers.fp8_linear.fp8_tensor_cores", lambda device: True)
    monkeypatch.setattr("engine.layers.fp8_block_linear.BLOCK_FP8_W8A16_MAX_ROWS", 0)
    monkeypatch.setattr("engine.layers.fp8_moe.FP8_MOE_W8A16_MAX_EXPERT_ROWS", 0)
    calls: tuple[list[int], list[int]] = ([], [])
    for seen, (module, name) in zip(
        calls, ((kernels.fp8_block_w8a8, "fp8_block_w8a8"),
                (kernels.fused_moe_fp8_w8a8, "fp8_moe_w8a8")), strict=True,
    ):  # fmt: skip
        real = getattr(module, name)

        def counted(x, *args, real=real, seen=seen, **kwargs):
            seen.append(x.shape[0])
            return real(x, *args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3-moe"])
def test_w8a8_route_matches_transformers(tmp_path, monkeypatch, caplog, family) -> None:
    prompts = make_prompts(128)[3:]  # 33, 8, 23 and 17 tokens (two sharing a prefix)
    if family == "llama":
        source = make_tiny_llama(tmp_path / "source", **LLAMA)
        block = (16, 128)
    elif family == "qwen3":
        source = make_tiny_model(tmp_path / "source", "Qwen3ForCausalLM", **QWEN3)
        block = (16, 32)
    else:
        source = make_tiny_model(tmp_path / "source", "Qwen3MoeForCausalLM",
                                 moe_intermediate_size=64, **QWEN3_MOE)  # fmt: skip
        block = (64, 64)
        prompts = prompts[:2]  # the experts' kernels are the interpreter's slowest
    path, reference_dir = make_block_fp8(source, tmp_path / "fp8", tmp_path / "ref", block)
    rows, expert_rows = _force_w8a8(monkeypatch)
    with caplog.at_level(logging.INFO, logger="engine.loader.model_loader"):
        llm, outputs = run(path, prompts)
    assert "W8A8 on FP8 tensor cores for prefill" in caplog.text
    layer = llm.llm_engine.runner.model.model.layers[0]
    if family == "qwen3-moe":
        gemm = layer.mlp._gemm
        assert gemm.prefill_kernel is not None and gemm.max_expert_rows == 0
        assert max(expert_rows) > 16 and min(expert_rows) == 1
    projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj)
    if family != "qwen3-moe":
        projections += (layer.mlp.down_proj,)
    for linear in projections:
        method = linear.quant_method
        assert isinstance(method, Fp8BlockLinearMethod)
        assert method.max_kernel_rows == 0 and method.prefill_gemm is not None
        assert linear.weight.dtype == torch.float8_e4m3fn
    assert max(rows) > 16 and min(rows) == 1  # prefill steps and decode steps both ran W8A8
    reference = hf_greedy(reference_dir, prompts, MAX_TOKENS)
    assert_close_to_reference(reference, ours_greedy(outputs))
