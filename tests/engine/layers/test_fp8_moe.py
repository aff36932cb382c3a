"""Mixture-of-experts experts kept in FP8 (engine/layers/fp8_moe.py, installed by
engine/loader/fp8_expert_weights.py): a Qwen3-MoE-shaped layer (and Mixtral's checkpoint
spelling) filled expert by expert from an FP8 checkpoint stream, block-scaled, per channel
and per tensor, against the float64 experts of the dequantized weights; the layers that
cannot keep FP8 left dequantized with the reason; which devices keep them; a weight swapped
under the layer (sleep/wake) seen at the next call. The grouped GEMM runs in Triton's
interpreter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from engine.config.weights.fp8_checkpoint import Fp8Scheme
from engine.layers.fp8_moe import (
    FP8_MOE_W8A16_MAX_EXPERT_ROWS,
    fp8_moe_kernel,
    fp8_moe_w8a8_kernel,
    moe_block_fits_kernel,
)
from engine.layers.moe import FusedMoE, MoESpec, moe_experts, select_experts, torch_grouped_gemm
from engine.layers.ops import silu_and_mul
from engine.loader.fp8_expert_weights import install_fp8_experts, keep_fp8_experts
from engine.loader.fp8_weights import Fp8Checkpoint
from engine.loader.weight_loader import load_weights
from tests.engine.block_fp8_checkpoints import dequantize_blocks_float64, quantize_blocks
from tests.triton_utils import import_triton

import_triton()


@pytest.fixture(autouse=True)
def _inference():
    with torch.inference_mode():  # as the engine runs its model
        yield


HIDDEN, EXPERTS, TOP_K = 80, 4, 2
QWEN3 = {
    "gate_proj": ("w13_weight", 0),
    "up_proj": ("w13_weight", 1),
    "down_proj": ("w2_weight", None),
}
MIXTRAL = {"w1": ("w13_weight", 0), "w3": ("w13_weight", 1), "w2": ("w2_weight", None)}
MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."),)


class TinyModel(nn.Module):
    """One MoE layer at `model.mlp` (the weight loader's and installer's walk finds it)."""

    def __init__(self, inter: int) -> None:
        super().__init__()
        config = SimpleNamespace(hidden_size=HIDDEN, hidden_act="silu")
        self.model = nn.Module()
        self.model.mlp = FusedMoE(config, MoESpec(EXPERTS, TOP_K, inter, True), "torch")


def _quantize(weight, block):
    if block in ("channel", "tensor"):  # amax / 448 per row ([N, 1]) or of the whole ([])
        amax = weight.abs().amax(dim=1, keepdim=True) if block == "channel" else weight.abs().max()
        scale = amax / 448
        q = (weight / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        return q, scale, q.double() * scale.double()
    q, scale = quantize_blocks(weight, block)
    return q, scale, dequantize_blocks_float64(q, scale, block)


def _checkpoint(inter, block, mapping=QWEN3, prefix="model.mlp", seed=0):
    """{name: tensor} of every expert's FP8 modules and the router; float64 stacks."""
    gen = torch.Generator().manual_seed(seed)
    gate, up, down = mapping  # the checkpoint's leaf names, in w13 / w13 / w2 order
    tensors = {f"{prefix}.gate.weight": torch.randn(EXPERTS, HIDDEN, generator=gen)}
    w13, w2 = [], []
    for e in range(EXPERTS):
        parts = {}
        for leaf, shape in (
            (gate, (inter, HIDDEN)),
            (up, (inter, HIDDEN)),
            (down, (HIDDEN, inter)),
        ):
            q, scale, real = _quantize(torch.randn(shape, generator=gen) * 0.1, block)
            tensors[f"{prefix}.experts.{e}.{leaf}.weight"] = q
            tensors[f"{prefix}.experts.{e}.{leaf}.weight_scale"] = scale
            parts[leaf] = real
        w13.append(torch.cat([parts[gate], parts[up]]))
        w2.append(parts[down])
    return tensors, torch.stack(w13), torch.stack(w2)


def _load(
    inter, block, mapping=QWEN3, substitutions=(), prefix="model.mlp", ignore=(), prefill=None
):
    strategy = block if isinstance(block, str) else "block"
    scheme = Fp8Scheme(strategy, "dynamic", ignore, False, None if strategy != "block" else block)
    with torch.device("meta"):
        model = TinyModel(inter)
    kept, num_layers, dequantized = install_fp8_experts(
        model, scheme, mapping, substitutions, fp8_moe_kernel(), prefill_kernel=prefill
    )
    model = model.to_empty(device="cpu")
    tensors, w13, w2 = _checkpoint(inter, block, mapping, prefix)
    stream = Fp8Checkpoint(scheme, torch.float32, kept).weights(tensors.items())
    load_weights(model, stream, {}, expert_weights_mapping=mapping,
                 weight_name_substitutions=substitutions)  # fmt: skip
    return model, (kept, num_layers, dequantized), w13, w2


def _expected(model, x, w13, w2):
    """The layer's experts on the float64 weights (routing from the same router)."""
    weights, ids = select_experts(model.model.mlp.gate(x), TOP_K, renormalize=True)
    return moe_experts(x.double(), w13, w2, weights.double(), ids, torch_grouped_gemm, silu_and_mul)


@pytest.mark.parametrize(
    "inter, block",
    [(64, (32, 32)), (48, (16, 32)), (40, "channel"), (24, "tensor")],
    ids=["32x32", "16x32", "channel", "tensor"],
)
def test_kept_experts_match_the_float64_experts(inter, block) -> None:
    """Blocks of 32 x 32 (hidden 80: ragged columns of w13 and rows of w2), 16 x 32,
    per-channel scales and per-tensor ones (spread over their rows: gate and up each keep
    their own); 7 tokens over 4 experts, top-2."""
    model, (kept, num_layers, dequantized), w13, w2 = _load(inter, block)
    assert num_layers == 1 and dequantized == []
    assert "model.mlp.experts.3.down_proj" in kept and len(kept) == 3 * EXPERTS
    moe = model.model.mlp
    assert moe.w13_weight.dtype == moe.w2_weight.dtype == torch.float8_e4m3fn
    if isinstance(block, str):
        assert moe.w13_weight_scale.shape == (EXPERTS, 2 * inter)
        assert moe._gemm.block is None
    else:
        grid = (EXPERTS, 2 * inter // block[0], -(-HIDDEN // block[1]))
        assert moe.w13_weight_scale.shape == grid
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(x).double(), _expected(model, x, w13, w2), atol=1e-5, rtol=1e-4)


def test_mixtral_names_are_found_through_the_substitutions() -> None:
    """Mixtral's checkpoint says `block_sparse_moe.experts.{e}.w1/w3/w2`; our layer is `mlp`."""
    model, (kept, num_layers, _), w13, w2 = _load(
        64, (32, 32), MIXTRAL, MIXTRAL_NAMES, prefix="model.block_sparse_moe"
    )
    assert num_layers == 1 and "model.block_sparse_moe.experts.0.w3" in kept
    x = torch.randn(3, HIDDEN)
    torch.testing.assert_close(
        model.model.mlp(x).double(), _expected(model, x, w13, w2), atol=1e-5, rtol=1e-4
    )


def test_gate_up_rows_not_whole_blocks_stay_dequantized() -> None:
    """inter = 40 in blocks of 32: w13's second shard would start mid-block."""
    model, (kept, num_layers, dequantized), w13, w2 = _load(40, (32, 32))
    assert kept == frozenset() and num_layers == 0
    reason = "its experts' gate | up rows [40, 40] are not whole blocks of 32"
    assert dequantized == [f"model.mlp experts: {reason}"]
    assert model.model.mlp.w13_weight.dtype == torch.float32 and not hasattr(
        model.model.mlp, "w13_weight_scale"
    )
    x = torch.randn(3, HIDDEN)
    torch.testing.assert_close(
        model.model.mlp(x).double(), _expected(model, x, w13, w2), atol=1e-5, rtol=1e-4
    )


def test_other_refusals() -> None:
    scheme = Fp8Scheme("block", "dynamic", (), False, (32, 32))
    with torch.device("meta"):
        model = TinyModel(64)
    model.model.mlp.checkpoint_slices = {"w13_weight": (0, ())}  # as a tensor-parallel slice
    _, _, dequantized = install_fp8_experts(model, scheme, QWEN3, (), fp8_moe_kernel())
    assert dequantized == ["model.mlp experts: its experts are split over tensor-parallel ranks"]
    with torch.device("meta"):
        model = TinyModel(64)
    refused = install_fp8_experts(model, scheme, QWEN3, (), fp8_moe_kernel(), False)
    assert refused[2] == ["model.mlp experts: the kernel does not take blocks [32, 32]"]
    half = Fp8Scheme("block", "dynamic", ("re:.*experts\\.0\\.",), False, (32, 32))
    _, _, dequantized = install_fp8_experts(model, half, QWEN3, (), fp8_moe_kernel())
    assert "quantizes some of its experts and not others" in dequantized[0]
    every = Fp8Scheme("block", "dynamic", ("re:.*experts",), False, (32, 32))
    assert install_fp8_experts(model, every, QWEN3, (), fp8_moe_kernel()) == (frozenset(), 0, [])
    assert moe_block_fits_kernel((128, 128)) and not moe_block_fits_kernel((128, 40))


def test_a_swapped_weight_is_seen() -> None:
    """Sleep/wake replace `.data`: the layer reads its FP8 stacks and scales at each call."""
    model, *_ = _load(64, (32, 32))
    moe = model.model.mlp
    x = torch.randn(2, HIDDEN)
    before = moe(x)
    moe.w2_weight.data = moe.w2_weight.data.clone()
    moe.w2_weight_scale.data = moe.w2_weight_scale.data * 2
    torch.testing.assert_close(moe(x), before * 2)


def test_which_devices_keep_fp8_experts(monkeypatch) -> None:
    """The block projections' rule: CUDA with Triton keeps the experts FP8 (whatever the
    scheme: the GEMM is W8A16), the CPU dequantizes; $PAGEDSERVE_FP8_COMPUTE's choice wins.
    (The "GPU" is an sm_90: block-scaled experts get the W8A8 kernel there too.)"""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))

    class Family(TinyModel):
        expert_weights_mapping = MIXTRAL
        weight_name_substitutions = MIXTRAL_NAMES

    def kept_layers(device, forced, scheme) -> int:
        with torch.device("meta"):
            model = Family(64)
        return keep_fp8_experts(model, scheme, torch.device(device), forced).num_layers

    block = Fp8Scheme("block", "dynamic", (), False, (32, 32))
    channel = Fp8Scheme("channel", "dynamic", ())
    assert kept_layers("cuda", None, block) == kept_layers("cuda", None, channel) == 1
    assert kept_layers("cpu", None, block) == kept_layers("cuda", False, channel) == 0
    assert kept_layers("cpu", True, channel) == 1
    with torch.device("meta"):
        model = Family(64)
    said = keep_fp8_experts(model, block, torch.device("cuda"), None).said()
    assert said == ", and the experts of 1 MoE layers (the Triton grouped GEMM)"
    monkeypatch.setattr("engine.loader.fp8_expert_weights.triton_available", lambda: False)
    assert kept_layers("cuda", None, block) == kept_layers("cpu", True, block) == 0


def _w8a8():
    from kernels.fused_moe_fp8_w8a8 import fp8_moe_w8a8

    return fp8_moe_w8a8


def test_busy_steps_take_w8a8(monkeypatch) -> None:
    """Up to `max_expert_rows` rows in the busiest expert the W8A16 kernel runs, beyond them
    the W8A8 one (activations quantized per token and block column: a looser match to the
    float64 experts); which ran is recorded around the real kernels."""
    from kernels.fused_moe_fp8 import fp8_moe_grouped_gemm

    model, _, w13, w2 = _load(64, (32, 32), prefill=_w8a8())
    moe = model.model.mlp
    assert moe._gemm.max_expert_rows == FP8_MOE_W8A16_MAX_EXPERT_ROWS
    moe._gemm.max_expert_rows = 3
    chosen = []
    for name, kernel in (("w8a16", fp8_moe_grouped_gemm), ("w8a8", _w8a8())):
        monkeypatch.setattr(moe._gemm, "kernel" if name == "w8a16" else "prefill_kernel",
                            lambda *a, k=kernel, n=name: chosen.append(n) or k(*a))  # fmt: skip
    for tokens in (1, 12):  # top-2 of 4 experts: 1 row each, then some expert gets > 3
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
        chosen.clear()
        out = moe(x).double()
        assert chosen == (["w8a16"] * 2 if tokens == 1 else ["w8a8"] * 2)  # w13, then w2
        tolerance = {"atol": 1e-5, "rtol": 1e-4} if tokens == 1 else {"atol": 0.05, "rtol": 0.1}
        torch.testing.assert_close(out, _expected(model, x, w13, w2), **tolerance)


def test_which_devices_and_blocks_run_w8a8(monkeypatch) -> None:
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability["value"])
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert fp8_moe_w8a8_kernel(cuda, (128, 128)) is _w8a8()
    assert fp8_moe_w8a8_kernel(cuda, None) is None  # per-channel experts
    assert fp8_moe_w8a8_kernel(cuda, (32, 48)) is None
    assert fp8_moe_w8a8_kernel(cpu, (128, 128)) is None
    capability["value"] = (8, 0)
    assert fp8_moe_w8a8_kernel(cuda, (128, 128)) is None
