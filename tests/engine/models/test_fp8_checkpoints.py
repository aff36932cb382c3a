"""FP8 checkpoints (compressed-tensors and ModelOpt layouts, made here from tiny random
models) served by the engine, against transformers on the same weights (DESIGN.md's top-5
rule), in every scheduling regime of test_engine_correctness.

- Dequantized at load (the CPU default): against transformers with the dequantized weights;
  every regime gives the unconstrained run's tokens.
- Kept in FP8 ($PAGEDSERVE_FP8_COMPUTE=fp8: `torch._scaled_mm`, activations quantized per
  token, as on an sm_89+ GPU): against transformers running the checkpoint as
  compressed-tensors does (weights dequantized, activations fake-quantized per token), the
  same math, in every regime.
"""

from __future__ import annotations

import pytest
import torch

from engine.layers.fp8_linear import FP8_COMPUTE_ENV
from tests.engine.fp8_checkpoints import (
    compressed_tensors_reference_kwargs,
    make_compressed_tensors_fp8,
    make_modelopt_fp8,
)
from tests.engine.models.test_engine_correctness import (
    MAX_TOKENS,
    REGIMES,
    assert_same_tokens_in_every_regime,
    make_prompts,
    run,
)
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy

SHAPE = dict(hidden_size=64, num_heads=4, num_kv_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module", params=["ct-fp8-dynamic", "ct-fp8-static", "modelopt-fp8"])
def checkpoint(request, tmp_path_factory):
    """(FP8 directory, transformers reference directory, its from_pretrained kwargs)."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "modelopt-fp8":
        path, reference = make_modelopt_fp8(root / "fp8", root / "reference", **SHAPE)
        return path, reference, {}
    scheme = "FP8_DYNAMIC" if request.param == "ct-fp8-dynamic" else "FP8"
    path = make_compressed_tensors_fp8(root / "fp8", scheme, **SHAPE)
    return path, path, compressed_tensors_reference_kwargs()


def test_dequantized_at_load_matches_transformers_in_every_regime(checkpoint, monkeypatch):
    monkeypatch.setenv(FP8_COMPUTE_ENV, "dequantize")
    path, reference_dir, load_kwargs = checkpoint
    prompts = make_prompts(128)
    reference = hf_greedy(reference_dir, prompts, MAX_TOKENS, **load_kwargs)
    llm, unconstrained = run(path, prompts)
    assert llm.llm_engine.get_model_config().quantization == "fp8"
    assert_close_to_reference(reference, ours_greedy(unconstrained))
    assert_same_tokens_in_every_regime(path, prompts, unconstrained)


def test_fp8_compute_matches_compressed_tensors_in_every_regime(tmp_path, monkeypatch):
    """The FP8 path (as on a GPU with FP8 tensor cores) against compressed-tensors' own
    W8A8 forward in transformers: per-token dynamic activations, per-channel weights."""
    monkeypatch.setenv(FP8_COMPUTE_ENV, "fp8")
    path = make_compressed_tensors_fp8(tmp_path / "fp8", "FP8_DYNAMIC", **SHAPE)
    prompts = make_prompts(128)
    reference = hf_greedy(path, prompts, MAX_TOKENS)  # compressed-tensors' fake-quant forward
    for name, kwargs in {"unconstrained": {}, **REGIMES}.items():
        llm, outputs = run(path, prompts, **kwargs)
        assert_close_to_reference(reference, ours_greedy(outputs))
        if name == "preemption-tiny-cache":
            assert llm.llm_engine.scheduler.num_preemptions_total > 0, "no preemption happened"
    qkv = llm.llm_engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.shape == (128,)
