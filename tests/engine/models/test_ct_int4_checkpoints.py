"""compressed-tensors `pack-quantized` INT4 checkpoints (llm-compressor's W4A16 and
W4A16_ASYM, written by the package itself: tests/engine/ct_int4_checkpoints.py) served by the
engine against transformers (DESIGN.md's top-5 rule), under every scheduling regime.

On the CPU symmetric checkpoints without act-order stay 4-bit in the native Q4_0 blocks (their
bf16 scales converted exactly) and the others are dequantized at load; CUDA's path (every
projection kept INT4 behind the Triton kernels) is forced here through the interpreter."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.int4_linear import Int4LinearMethod
from engine.layers.linear import Linear
from engine.loader import int4_weights
from tests.engine.ct_int4_checkpoints import CT_MISSING, write_ct_int4_checkpoint
from tests.engine.fp8_checkpoints import compressed_tensors_reference_kwargs
from tests.engine.models.test_engine_correctness import (
    assert_same_tokens_in_every_regime,
    make_prompts,
    run,
)
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.model_utils import make_tiny_model
from tests.triton_utils import import_triton

pytest.importorskip("compressed_tensors", reason=CT_MISSING)

MAX_TOKENS = 24
SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=256,
)
# case -> (family, write_ct_int4_checkpoint's settings)
CASES = {
    "llama-w4a16-g128": ("LlamaForCausalLM", dict()),
    "llama-asym-g64-act-order": (
        "LlamaForCausalLM",
        dict(symmetric=False, group_size=64, act_order=True),
    ),
    "qwen2-w4a16-channel": ("Qwen2ForCausalLM", dict(group_size=-1)),
    "qwen2-asym-g32": ("Qwen2ForCausalLM", dict(symmetric=False, group_size=32)),
}
ALL_REGIMES = ("llama-w4a16-g128", "qwen2-asym-g32")  # the others: the unconstrained run only
# Symmetric without act-order: 4 fused projections x 2 layers kept in Q4_0 blocks; otherwise
# 7 checkpoint projections x 2 layers dequantized, said once.
KEPT = "Kept 8 projections in INT4 (COMPRESSED-TENSORS, native Q4_0 blocks)"
DEQUANTIZED = "Dequantized 14 COMPRESSED-TENSORS INT4 projections"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """family -> a tiny random model of it (fp32)."""
    root = tmp_path_factory.mktemp("sources")
    return {
        family: make_tiny_model(root / family, family, **SHAPE)
        for family in ("LlamaForCausalLM", "Qwen2ForCausalLM")
    }


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers_on_the_dequantized_model(case, sources, tmp_path, caplog):
    family, settings = CASES[case]
    quant_dir, ref_dir = write_ct_int4_checkpoint(sources[family], tmp_path, **settings)
    prompts = make_prompts(128)
    reference = hf_greedy(ref_dir, prompts, MAX_TOKENS)
    with caplog.at_level(logging.INFO, logger="engine.loader.int4_weights"):
        llm, unconstrained = run(quant_dir, prompts)
    assert llm.llm_engine.get_model_config().quantization == "compressed-tensors"
    native = settings.get("symmetric", True) and not settings.get("act_order")
    assert (KEPT if native else DEQUANTIZED) in caplog.text
    assert_close_to_reference(reference, ours_greedy(unconstrained))
    if case not in ALL_REGIMES:
        return
    assert_same_tokens_in_every_regime(quant_dir, prompts, unconstrained)


def test_matches_transformers_reading_the_checkpoint_itself(sources, tmp_path) -> None:
    """transformers loads the same files through its compressed-tensors integration (the
    package decompresses them, rounding each weight to bf16): the top-5 rule still holds."""
    quant_dir, _ = write_ct_int4_checkpoint(sources["LlamaForCausalLM"], tmp_path)
    prompts = make_prompts(128)
    reference = hf_greedy(quant_dir, prompts, MAX_TOKENS, **compressed_tensors_reference_kwargs())
    _, outputs = run(quant_dir, prompts)
    assert_close_to_reference(reference, ours_greedy(outputs))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-forced path of CUDA's branch")
def test_kept_int4_as_on_cuda_matches_dequantized_loading(sources, tmp_path, monkeypatch):
    """Every projection kept INT4 behind the Triton kernels (interpreter; zero points and
    act-order's gathered columns included) gives the tokens of dequantized loading."""
    import_triton()
    settings = CASES["llama-asym-g64-act-order"][1]
    quant_dir, _ = write_ct_int4_checkpoint(sources["LlamaForCausalLM"], tmp_path, **settings)
    prompts = [[5, 9, 17, 3, 44, 61, 2, 8, 90, 11], [7, 7, 30]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def generate():
        llm = LLM(model=str(quant_dir), device="cpu", dtype="float32", max_model_len=64)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return llm, [o.outputs[0].token_ids for o in outputs]

    _, dequantized = generate()
    monkeypatch.setattr(int4_weights, "int4_kept_packed", lambda device: True)
    monkeypatch.setattr("engine.layers.int4_linear.INT4_GEMM_MAX_ROWS", 4)  # prefill: dequantize
    llm, kept = generate()
    assert kept == dequantized
    model = llm.llm_engine.executor.runner.model  # one process: the uniproc executor
    methods = [m.quant_method for m in model.modules() if isinstance(m, Linear)]
    # act-order shards keep their own input order: 2 layers x (q, k, v, o, gate, up, down)
    parts = [len(m.parts) for m in methods if isinstance(m, Int4LinearMethod)]
    assert len(parts) == 8 and sum(parts) == 14


def test_unserved_checkpoint_is_refused_before_loading(sources, tmp_path) -> None:
    quant_dir, _ = write_ct_int4_checkpoint(sources["LlamaForCausalLM"], tmp_path)
    path = quant_dir / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weights\.num_bits=8 is not served"):
        LLM(model=str(quant_dir), max_model_len=64)
    config["quantization_config"]["format"] = "int-quantized"
    del config["quantization_config"]["config_groups"]["group_0"]["format"]
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="format='int-quantized' is not served"):
        LLM(model=str(quant_dir), max_model_len=64)
