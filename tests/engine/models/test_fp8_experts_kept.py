"""Block-scaled FP8 mixture-of-experts checkpoints whose experts stay FP8 (the CUDA path:
engine/layers/fp8_moe.py, installed by engine/loader/fp8_expert_weights.py), forced on the
CPU with $PAGEDSERVE_FP8_COMPUTE=fp8 so the grouped FP8 GEMM (kernels/fused_moe_fp8.py)
runs in Triton's interpreter: a tiny Qwen3-MoE in Qwen3-30B-A3B-FP8's layout gives the
same greedy tokens as the same checkpoint dequantized at load, and transformers' on the
dequantized weights within DESIGN.md's top-5 rule; one whose experts' gate | up rows are
not whole blocks keeps them dequantized and says so once; a compressed-tensors per-channel
checkpoint whose experts (only) are FP8 keeps them FP8 too, same tokens. (DeepSeek-V3's
release layout: test_block_fp8_kept.py.)"""

from __future__ import annotations

import json
import logging
import shutil

import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.layers.fp8_linear import FP8_COMPUTE_ENV
from engine.layers.fp8_moe import Fp8ExpertGemm
from tests.engine.block_fp8_checkpoints import make_block_fp8
from tests.engine.models.test_engine_correctness import make_prompts
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.model_utils import make_tiny_model
from tests.triton_utils import import_triton

import_triton()

# hidden 80 in blocks of 64: w13's columns and w2's rows end in a ragged block; one layer
# (the interpreter takes tens of ms a launch: wide blocks make few programs).
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


def _per_channel_experts(source, path, reference):
    """compressed-tensors' per-channel FP8 layout (weight_scale [N, 1], dynamic per-token
    activations in the config) with only the experts quantized (the rest in `ignore`), and
    the dequantized reference; written by hand from the format's definition."""
    tensors = load_file(source / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        quantized[name] = dequantized[name] = tensor
        if ".experts." in name and name.endswith("_proj.weight"):
            scale = tensor.abs().amax(dim=1, keepdim=True) / 448  # [N, 1]
            q = (tensor / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            quantized[name] = q
            quantized[name.removesuffix("weight") + "weight_scale"] = scale
            dequantized[name] = q.float() * scale
    eight_bit = {"num_bits": 8, "type": "float", "symmetric": True}
    group = {
        "targets": ["Linear"],
        "weights": {**eight_bit, "dynamic": False, "strategy": "channel"},
        "input_activations": {**eight_bit, "dynamic": True, "strategy": "token"},
    }
    for directory, out in ((path, quantized), (reference, dequantized)):
        shutil.copytree(source, directory)
        save_file(out, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head", "re:.*self_attn\\..*", "re:.*mlp\\.gate$"],
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path, reference


def _load_both(tmp_path, monkeypatch, caplog, moe_intermediate_size, per_channel=False):
    source = make_tiny_model(
        tmp_path / "source", "Qwen3MoeForCausalLM",
        moe_intermediate_size=moe_intermediate_size, **QWEN3_MOE,
    )  # fmt: skip
    if per_channel:
        path, reference = _per_channel_experts(source, tmp_path / "fp8", tmp_path / "ref")
    else:
        path, reference = make_block_fp8(source, tmp_path / "fp8", tmp_path / "ref", (64, 64))
    prompts = make_prompts(128)[1:3]  # 5 and 17 tokens
    monkeypatch.setenv(FP8_COMPUTE_ENV, "dequantize")
    _, dequantized = run(path, prompts)
    if per_channel:  # the auto choice on a CUDA GPU without FP8 tensor cores (Ampere):
        # the dense projections dequantized, the experts kept (W8A16 needs none)
        monkeypatch.delenv(FP8_COMPUTE_ENV, raising=False)
        monkeypatch.setattr(
            "engine.loader.fp8_expert_weights.keeps_block_fp8", lambda device, forced: True
        )
    else:
        monkeypatch.setenv(FP8_COMPUTE_ENV, "fp8")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        llm, kept = run(path, prompts)
    said = [r.getMessage() for r in caplog.records if "FP8 checkpoint" in r.getMessage()]
    assert len(said) == 1, said
    moe = llm.llm_engine.runner.model.model.layers[0].mlp
    return moe, said[0], kept, dequantized, reference, prompts


def test_qwen3_moe_experts_kept_in_fp8(tmp_path, monkeypatch, caplog) -> None:
    """moe_intermediate_size 64: a whole block per shard, so the experts stay FP8."""
    moe, said, kept, dequantized, reference, prompts = _load_both(tmp_path, monkeypatch, caplog, 64)
    assert "the experts of 1 MoE layers (the Triton grouped GEMM)" in said
    assert "; 0 dequantized" in said and "4 projections run in FP8" in said  # q, k, v, o
    assert moe.w13_weight.dtype == moe.w2_weight.dtype == torch.float8_e4m3fn
    assert moe.w13_weight_scale.shape == (4, 2, 2)  # 128 rows, 80 columns in 64 x 64
    assert moe.w2_weight_scale.shape == (4, 2, 1)  # 80 rows, 64 columns
    assert isinstance(moe._gemm, Fp8ExpertGemm)
    assert _greedy_ids(kept) == _greedy_ids(dequantized)
    assert_close_to_reference(hf_greedy(reference, prompts, MAX_NEW), ours_greedy(kept))


def test_experts_not_whole_blocks_stay_dequantized(tmp_path, monkeypatch, caplog) -> None:
    """moe_intermediate_size 40 in blocks of 64: up's rows would start mid-block."""
    moe, said, kept, dequantized, *_ = _load_both(tmp_path, monkeypatch, caplog, 40)
    assert "MoE layers" not in said and "1 dequantized" in said
    assert "model.layers.0.mlp experts: its experts' gate | up rows [40, 40]" in said
    assert moe.w13_weight.dtype == torch.float32 and not hasattr(moe, "w13_weight_scale")
    assert _greedy_ids(kept) == _greedy_ids(dequantized)


def test_per_channel_experts_kept_in_fp8(tmp_path, monkeypatch, caplog) -> None:
    """Per-channel experts (compressed-tensors FP8 Mixtral / Qwen3-MoE) where Triton runs
    but FP8 tensor cores do not: the grouped GEMM's per-channel mode, one scale per output
    row after the K loop; moe_intermediate_size 40 (no block to fit)."""
    moe, said, kept, dequantized, reference, prompts = _load_both(
        tmp_path, monkeypatch, caplog, 40, per_channel=True
    )
    assert "dequantized to torch.float32 at load except the experts of 1 MoE layers" in said
    assert moe.w13_weight.dtype == torch.float8_e4m3fn and moe._gemm.block is None
    assert moe.w13_weight_scale.shape == (4, 80) and moe.w2_weight_scale.shape == (4, 80)
    assert _greedy_ids(kept) == _greedy_ids(dequantized)
    assert_close_to_reference(hf_greedy(reference, prompts, MAX_NEW), ours_greedy(kept))
