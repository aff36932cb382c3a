"""Block-scaled FP8 mixture-of-experts checkpoints whose experts stay FP8 (the CUDA path:
engine/layers/fp8_moe.py, installed by engine/loader/fp8_expert_weights.py), forced on the
CPU with $PAGEDSERVE_FP8_COMPUTE=fp8 so the grouped FP8 GEMM (kernels/fused_moe_fp8.py)
runs in Triton's interpreter: a tiny Qwen3-MoE in Qwen3-30B-A3B-FP8's layout gives the
same greedy tokens as the same checkpoint dequantized at load, and transformers' on the
dequantized weights within DESIGN.md's top-5 rule; one whose experts' gate | up rows are
not whole blocks keeps them dequantized and says so once. (DeepSeek-V3's release layout:
test_block_fp8_kept.py.)"""

from __future__ import annotations

import logging

import torch

from engine import LLM, SamplingParams
from engine.layers.fp8_linear import FP8_COMPUTE_ENV
from engine.layers.fp8_moe import Fp8ExpertGemm
from tests.engine.block_fp8_checkpoints import make_block_fp8
from tests.engine.models.test_engine_correctness import make_prompts
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.model_utils import make_tiny_model
from tests.triton_utils import import_triton

import_triton()

# hidden 80 in blocks of 32: w13's columns and w2's rows end in a ragged block; one layer
# (the interpreter takes tens of ms a launch).
# q|k|v rows 128 / 64 / 64: whole blocks, so attention stays FP8 as well.
QWEN3_MOE = dict(hidden_size=80, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=96,
                 num_experts=4, num_experts_per_tok=2, num_layers=1)  # fmt: skip
MAX_NEW = 5  # the interpreter's launches are what these tests spend
LOGGER = "engine.loader.model_loader"


def _greedy_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def run(path, prompts):
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _load_both(tmp_path, monkeypatch, caplog, moe_intermediate_size):
    source = make_tiny_model(
        tmp_path / "source", "Qwen3MoeForCausalLM",
        moe_intermediate_size=moe_intermediate_size, **QWEN3_MOE,
    )  # fmt: skip
    path, reference = make_block_fp8(source, tmp_path / "fp8", tmp_path / "ref", (32, 32))
    prompts = make_prompts(128)[1:3]  # 5 and 17 tokens
    monkeypatch.setenv(FP8_COMPUTE_ENV, "dequantize")
    _, dequantized = run(path, prompts)
    monkeypatch.setenv(FP8_COMPUTE_ENV, "fp8")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        llm, kept = run(path, prompts)
    said = [r.getMessage() for r in caplog.records if "Block-scaled FP8" in r.getMessage()]
    assert len(said) == 1, said
    moe = llm.llm_engine.runner.model.model.layers[0].mlp
    return moe, said[0], kept, dequantized, reference, prompts


def test_qwen3_moe_experts_kept_in_fp8(tmp_path, monkeypatch, caplog) -> None:
    """moe_intermediate_size 64: two whole blocks per shard, so the experts stay FP8."""
    moe, said, kept, dequantized, reference, prompts = _load_both(tmp_path, monkeypatch, caplog, 64)
    assert "the experts of 1 MoE layers (the Triton grouped GEMM)" in said
    assert "; 0 dequantized" in said and "4 projections run in FP8" in said  # q, k, v, o
    assert moe.w13_weight.dtype == moe.w2_weight.dtype == torch.float8_e4m3fn
    assert moe.w13_weight_scale.shape == (4, 4, 3)  # 128 rows, 80 columns in 32 x 32
    assert moe.w2_weight_scale.shape == (4, 3, 2)  # 80 rows, 64 columns
    assert isinstance(moe._gemm, Fp8ExpertGemm)
    assert _greedy_ids(kept) == _greedy_ids(dequantized)
    assert_close_to_reference(hf_greedy(reference, prompts, MAX_NEW), ours_greedy(kept))


def test_experts_not_whole_blocks_stay_dequantized(tmp_path, monkeypatch, caplog) -> None:
    """moe_intermediate_size 40 in blocks of 32: up's rows would start mid-block."""
    moe, said, kept, dequantized, *_ = _load_both(tmp_path, monkeypatch, caplog, 40)
    assert "MoE layers" not in said and "1 dequantized" in said
    assert "model.layers.0.mlp experts: its experts' gate | up rows [40, 40]" in said
    assert moe.w13_weight.dtype == torch.float32 and not hasattr(moe, "w13_weight_scale")
    assert _greedy_ids(kept) == _greedy_ids(dequantized)
