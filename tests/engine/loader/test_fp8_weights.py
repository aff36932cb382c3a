"""The FP8 checkpoint stream (engine/loader/fp8_weights.py): pairs found in any order,
dequantized or kept with per-row scales, KV scales collected, lone tensors refused; and a
fused layer filled shard by shard with each shard's own per-tensor scale."""

from __future__ import annotations

import pytest
import torch

from engine.config.weights.fp8_checkpoint import Fp8Scheme
from engine.layers.fp8_linear import FP8_DTYPE, fp8_gemv_kernel
from engine.layers.linear import Linear
from engine.loader.fp8_weights import Fp8Checkpoint, dequantize_fp8, install_fp8_layers
from engine.loader.weight_loader import load_weights
from tests.triton_utils import import_triton

TENSOR = Fp8Scheme("tensor", "static", ("lm_head",), True)


def _fp8(rows: int, cols: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=generator) * 100).to(FP8_DTYPE)


def test_dequantize_per_channel_and_per_tensor() -> None:
    w = _fp8(4, 8, 0)
    per_channel = torch.tensor([[0.5], [1.0], [2.0], [4.0]])
    torch.testing.assert_close(
        dequantize_fp8(w, per_channel, torch.float32), w.float() * per_channel
    )
    for scalar in (torch.tensor(0.25), torch.tensor([0.25])):
        torch.testing.assert_close(dequantize_fp8(w, scalar, torch.float32), w.float() * 0.25)


def test_pairs_in_any_order_dequantized_kv_scales_collected() -> None:
    w1, w2 = _fp8(4, 8, 1), _fp8(2, 8, 2)
    stream = [
        ("a.q_proj.weight_scale", torch.tensor(0.5)),  # the scale first
        ("a.q_proj.input_scale", torch.tensor(0.1)),  # dropped
        ("a.norm.weight", torch.ones(8)),  # not FP8: passes through
        ("a.o_proj.weight", w2),
        ("a.q_proj.weight", w1),
        ("a.o_proj.weight_scale", torch.tensor([[1.0], [2.0]])),
        ("a.k_proj.k_scale", torch.tensor(0.75)),
        ("a.v_scale", torch.tensor(0.125)),
    ]
    checkpoint = Fp8Checkpoint(TENSOR, torch.float32)
    out = dict(checkpoint.weights(iter(stream)))
    assert sorted(out) == ["a.norm.weight", "a.o_proj.weight", "a.q_proj.weight"]
    torch.testing.assert_close(out["a.q_proj.weight"], w1.float() * 0.5)
    torch.testing.assert_close(out["a.o_proj.weight"], w2.float() * torch.tensor([[1.0], [2.0]]))
    assert checkpoint.kv_scales == {"a": {"k_scale": 0.75, "v_scale": 0.125}}


def test_a_weight_without_its_scale_is_refused() -> None:
    checkpoint = Fp8Checkpoint(TENSOR, torch.float32)
    with pytest.raises(ValueError, match="without their pair"):
        list(checkpoint.weights(iter([("m.q_proj.weight", _fp8(2, 8, 3))])))


@pytest.mark.parametrize("triton", [False, True], ids=["cpu", "cuda-gemv"])
def test_fused_layer_keeps_fp8_with_each_shards_scale(triton) -> None:
    """q | k | v with per-tensor scales 0.5, 2, 8: one fp8 matrix, per-row scales; on the
    CPU through `_scaled_mm`, and as a CUDA model's layers (the decode-row GEMV, here in
    Triton's interpreter)."""
    if triton:
        import_triton()
    model = torch.nn.Module()
    with torch.device("meta"):
        model.qkv_proj = Linear(8, 10, bias=False, output_sizes=(4, 4, 2))
    packed = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
    kept = install_fp8_layers(model, TENSOR, packed, gemv=fp8_gemv_kernel(triton))
    assert (model.qkv_proj.quant_method.crossover_key() is not None) == triton
    assert kept == {"q_proj", "k_proj", "v_proj"}
    model = model.to_empty(device="cpu")
    shards = {
        "q_proj": (_fp8(4, 8, 4), 0.5),
        "k_proj": (_fp8(4, 8, 5), 2.0),
        "v_proj": (_fp8(2, 8, 6), 8.0),
    }
    stream = []
    for name, (w, s) in shards.items():
        stream += [(f"{name}.weight", w), (f"{name}.weight_scale", torch.tensor(s))]
    load_weights(model, Fp8Checkpoint(TENSOR, torch.float32, kept).weights(stream), packed)
    layer = model.qkv_proj
    assert layer.weight.dtype == FP8_DTYPE
    torch.testing.assert_close(layer.weight_scale, torch.tensor([0.5] * 4 + [2.0] * 4 + [8.0] * 2))
    expected = torch.cat([w.float() * s for w, s in shards.values()])
    x = torch.randn(3, 8)
    # the FP8 layer's output is that of the dequantized weight, up to the activations'
    # FP8 rounding (<= 2^-4 of each |x|, plus the subnormal step)
    got, want = layer(x), x @ expected.T
    bound = (x.abs() / 16 + 2.0**-10 * x.abs().amax(dim=1, keepdim=True) / 448) @ expected.abs().T
    assert bool(((got - want).abs() <= bound + 1e-5).all())


def test_a_kept_module_stored_unquantized_is_refused() -> None:
    checkpoint = Fp8Checkpoint(TENSOR, torch.float32, frozenset({"q_proj"}))
    with pytest.raises(ValueError, match="the config makes it FP8"):
        list(checkpoint.weights(iter([("q_proj.weight", torch.ones(2, 2))])))


def test_dummy_weights_of_an_fp8_model(tmp_path, monkeypatch) -> None:
    """load_format="dummy" over an FP8 config (the GPU benchmark's 8B model): FP8 weights
    drawn over E4M3's range, per-row scales making them vLLM's dummy range, tokens served."""
    import json

    from benchmarks.gpu.fp8_decode import write_fp8_model_dir
    from engine import LLM, SamplingParams
    from engine.loader.dummy_weights import DUMMY_RANGE

    monkeypatch.setenv("PAGEDSERVE_FP8_COMPUTE", "fp8")
    model_dir = write_fp8_model_dir("tiny", tmp_path)
    assert json.loads((model_dir / "config.json").read_text())["quantization_config"]
    llm = LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, max_model_len=64)
    layer = llm.llm_engine.runner.model.model.layers[0].mlp.gate_up_proj
    assert layer.weight.dtype == FP8_DTYPE
    assert layer.weight.float().abs().max() > 100  # spread over E4M3's range, not all ~0
    torch.testing.assert_close(
        layer.weight_scale, torch.full_like(layer.weight_scale, DUMMY_RANGE / 448)
    )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
