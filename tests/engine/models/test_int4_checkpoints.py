"""AWQ and GPTQ checkpoints (made by tests/engine/int4_checkpoints.py in the Hub's layout)
served by the engine against transformers on the same model with the dequantized weights
(DESIGN.md's top-5 rule), under every scheduling regime; on the CPU symmetric GPTQ stays
4-bit in the native Q4_0 blocks and the others are dequantized at load (the Triton path,
CUDA's, is forced through the interpreter in tests/engine/layers/test_int4_linear.py)."""

from __future__ import annotations

import logging

import pytest

from engine import LLM
from tests.engine.int4_checkpoints import write_int4_checkpoint
from tests.engine.models.test_engine_correctness import (
    assert_same_tokens_in_every_regime,
    make_prompts,
    run,
)
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.model_utils import make_tiny_llama

MAX_TOKENS = 24
CASES = {
    "awq-g128": dict(method="awq", group_size=128),
    "gptq-sym-g128": dict(method="gptq", group_size=128, sym=True),
    "gptq-asym-act-order": dict(method="gptq", group_size=64, desc_act=True),
    "gptq-v2-per-channel": dict(method="gptq_v2", group_size=-1),
}
ALL_REGIMES = ("awq-g128", "gptq-sym-g128")  # the others: the unconstrained run only


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp32")
    return make_tiny_llama(
        path,
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=256,
    )


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers_on_the_dequantized_model(case, tiny_llama, tmp_path, caplog):
    quant_dir, ref_dir = write_int4_checkpoint(tiny_llama, tmp_path, **CASES[case])
    prompts = make_prompts(128)
    reference = hf_greedy(ref_dir, prompts, MAX_TOKENS)
    with caplog.at_level(logging.INFO, logger="engine.loader.int4_weights"):
        llm, unconstrained = run(quant_dir, prompts)
    method = "awq" if case.startswith("awq") else "gptq"
    assert llm.llm_engine.get_model_config().quantization == method
    # Symmetric GPTQ stays INT4 in the native Q4_0 blocks (4 fused projections x 2 layers);
    # the others are dequantized (7 checkpoint projections x 2 layers), said once.
    kept = "Kept 8 projections in INT4 (GPTQ, native Q4_0 blocks)"
    expected = kept if CASES[case].get("sym") else "Dequantized 14"
    assert expected in caplog.text
    assert_close_to_reference(reference, ours_greedy(unconstrained))
    if case not in ALL_REGIMES:
        return
    assert_same_tokens_in_every_regime(quant_dir, prompts, unconstrained)


def test_unserved_checkpoint_is_refused_before_loading(tiny_llama, tmp_path) -> None:
    import json

    quant_dir, _ = write_int4_checkpoint(tiny_llama, tmp_path, "gptq")
    config = json.loads((quant_dir / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (quant_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPTQ checkpoint: bits=8 is not served"):
        LLM(model=str(quant_dir), max_model_len=64)
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (quant_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method='bitsandbytes' is not served"):
        LLM(model=str(quant_dir), max_model_len=64)
