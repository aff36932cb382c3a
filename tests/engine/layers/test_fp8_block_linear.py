"""Block-scaled FP8 projections kept in FP8 (engine/layers/fp8_block_linear.py, installed by
engine/loader/block_fp8_weights.py): a fused q|k|v and gate|up filled shard by shard from a
checkpoint stream (their scale grids stacked), against the float64 product of the
dequantized shards; a fused layer with ragged shard rows left dequantized; a weight swapped
under the layer (sleep/wake) seen at the next call. The GEMM runs in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config.weights.fp8_checkpoint import Fp8Scheme
from engine.layers.crossover import KERNEL_ROWS_ENV, plan_crossovers
from engine.layers.fp8_block_linear import (
    BLOCK_FP8_W8A16_MAX_ROWS,
    Fp8BlockLinearMethod,
    block_fits_kernel,
    block_fp8_gemm_kernel,
    block_fp8_w8a8_kernel,
    fused_rows_fit,
    keeps_block_fp8,
)
from engine.layers.linear import Linear
from engine.loader.block_fp8_weights import install_block_fp8_layers
from engine.loader.fp8_weights import Fp8Checkpoint
from engine.loader.weight_loader import load_weights
from tests.engine.block_fp8_checkpoints import dequantize_blocks_float64, quantize_blocks
from tests.triton_utils import import_triton

import_triton()

PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
HIDDEN = 48


class TinyBlock(nn.Module):
    """A fused q|k|v (shard rows `qkv`), a fused gate|up and an unfused down projection."""

    def __init__(self, qkv: tuple[int, int, int], inter: int) -> None:
        super().__init__()
        self.qkv_proj = Linear(HIDDEN, sum(qkv), bias=True, output_sizes=qkv)
        self.gate_up_proj = Linear(HIDDEN, 2 * inter, bias=False, output_sizes=(inter, inter))
        self.down_proj = Linear(inter, HIDDEN, bias=False)  # ragged rows and columns


def _checkpoint(qkv, inter, block, seed=0):
    """{name: tensor} of the quantized modules (+ q|k|v's biases), and the float64 weights."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "q_proj": (qkv[0], HIDDEN), "k_proj": (qkv[1], HIDDEN), "v_proj": (qkv[2], HIDDEN),
        "gate_proj": (inter, HIDDEN), "up_proj": (inter, HIDDEN), "down_proj": (HIDDEN, inter),
    }  # fmt: skip
    tensors, reference = {}, {}
    for module, shape in shapes.items():
        q, scale = quantize_blocks(torch.randn(shape, generator=gen) * 0.1, block)
        tensors[f"{module}.weight"], tensors[f"{module}.weight_scale_inv"] = q, scale
        reference[module] = dequantize_blocks_float64(q, scale, block)
    for module, rows in zip(("q_proj", "k_proj", "v_proj"), qkv, strict=True):
        tensors[f"{module}.bias"] = torch.randn(rows, generator=gen)
    return tensors, reference


def _load(qkv, inter, block, prefill_gemm=None):
    scheme = Fp8Scheme("block", "dynamic", (), False, block)
    with torch.device("meta"):
        model = TinyBlock(qkv, inter)
    kept, dequantized = install_block_fp8_layers(
        model, scheme, PACKED, block_fp8_gemm_kernel(), prefill_gemm=prefill_gemm
    )
    model = model.to_empty(device="cpu")
    tensors, reference = _checkpoint(qkv, inter, block)
    stream = Fp8Checkpoint(scheme, torch.float32, kept).weights(tensors.items())
    load_weights(model, stream, PACKED)
    return model, kept, dequantized, tensors, reference


def _expected(x, reference, tensors, members, bias=False):
    weight = torch.cat([reference[m] for m in members])
    out = x.double() @ weight.T
    if bias:
        out = out + torch.cat([tensors[f"{m}.bias"] for m in members]).double()
    return out


@pytest.mark.parametrize("rows", [1, 5, 20])
def test_fused_shards_stack_their_scale_grids(rows) -> None:
    """q|k|v shards of 32 / 16 / 16 rows in blocks of 16 x 32: every shard whole blocks, so
    the layer keeps FP8 with a [4, 2] grid (ragged columns: 48 = 32 + 16)."""
    block = (16, 32)
    model, kept, dequantized, tensors, reference = _load((32, 16, 16), 32, block)
    assert dequantized == [] and "k_proj" in kept and "down_proj" in kept
    qkv = model.qkv_proj
    assert isinstance(qkv.quant_method, Fp8BlockLinearMethod)
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.shape == (4, 2)
    # k_proj's scale rows landed at its weight rows / 16: row block 2
    torch.testing.assert_close(qkv.weight_scale[2], tensors["k_proj.weight_scale_inv"][0])
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    for layer, members, bias in [
        (qkv, ("q_proj", "k_proj", "v_proj"), True),
        (model.gate_up_proj, ("gate_proj", "up_proj"), False),
    ]:
        out = layer(x)
        expected = _expected(x, reference, tensors, members, bias)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    down = model.down_proj(x[:, :32].contiguous())
    expected = x[:, :32].double() @ reference["down_proj"].T
    torch.testing.assert_close(down.double(), expected, atol=1e-5, rtol=1e-5)


def test_ragged_shard_rows_stay_dequantized() -> None:
    """k / v shards of 8 rows in blocks of 16: the q|k|v grid cannot stack, so that layer
    loads dequantized (and says why) while gate|up (24 rows: ragged too) and down keep FP8
    only where they can."""
    block = (16, 32)
    model, kept, dequantized, tensors, reference = _load((32, 8, 8), 24, block)
    assert [d.split(":")[0] for d in dequantized] == ["qkv_proj", "gate_up_proj"]
    assert "not whole blocks" in dequantized[0]
    assert kept == {"down_proj"}
    assert model.qkv_proj.quant_method is None and model.qkv_proj.weight.dtype == torch.float32
    x = torch.randn(3, HIDDEN)
    expected = _expected(x, reference, tensors, ("q_proj", "k_proj", "v_proj"), True)
    torch.testing.assert_close(model.qkv_proj(x).double(), expected, atol=1e-4, rtol=1e-4)
    assert isinstance(model.down_proj.quant_method, Fp8BlockLinearMethod)


def test_a_swapped_weight_is_seen() -> None:
    """Sleep/wake replace `.data`: the method reads the layer's tensors at each call."""
    model, *_ = _load((32, 16, 16), 32, (16, 32))
    layer = model.down_proj
    x = torch.randn(2, 32)
    before = layer(x)
    layer.weight.data = layer.weight.data.clone()
    layer.weight_scale.data = layer.weight_scale.data * 2
    torch.testing.assert_close(layer(x), before * 2)


def test_rules() -> None:
    assert fused_rows_fit(Linear(8, 48, output_sizes=(32, 16)), (16, 16))
    assert not fused_rows_fit(Linear(8, 40, output_sizes=(32, 8)), (16, 16))
    assert fused_rows_fit(Linear(8, 40), (16, 16))  # unfused: a ragged last block is fine
    assert block_fits_kernel((128, 128)) and not block_fits_kernel((128, 40))


def test_which_devices_keep_block_fp8(monkeypatch) -> None:
    """The auto choice: CUDA with Triton keeps FP8 (no FP8 tensor cores needed), the CPU
    dequantizes; $PAGEDSERVE_FP8_COMPUTE's choice wins on either."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert keeps_block_fp8(cuda, None) and not keeps_block_fp8(cpu, None)
    assert keeps_block_fp8(cpu, True) and not keeps_block_fp8(cuda, False)
    monkeypatch.setattr("engine.layers.fp8_block_linear.triton_available", lambda: False)
    assert not keeps_block_fp8(cuda, None)


def _w8a8():
    from kernels.fp8_block_w8a8 import fp8_block_w8a8

    return fp8_block_w8a8


def test_rows_beyond_the_threshold_take_w8a8() -> None:
    """Up to `max_kernel_rows` rows the W8A16 GEMM's exact values, beyond them the W8A8
    GEMM's (activations quantized per token and block column): each route's output bit for
    bit, both within FP8's activation error of the float64 product."""
    from kernels.fp8_block_gemm import fp8_block_gemm

    block = (16, 32)
    model, _, _, tensors, reference = _load((32, 16, 16), 32, block, prefill_gemm=_w8a8())
    layer = model.gate_up_proj
    method = layer.quant_method
    assert method.max_kernel_rows == BLOCK_FP8_W8A16_MAX_ROWS
    method.max_kernel_rows = 4
    assert method.crossover_key() == "fp8-block 64x48 16x32"
    for rows, gemm in [(4, fp8_block_gemm), (5, _w8a8())]:
        x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
        out = layer(x)
        assert torch.equal(out, gemm(x, layer.weight, layer.weight_scale, block))
        expected = _expected(x, reference, tensors, ("gate_proj", "up_proj"))
        torch.testing.assert_close(out.double(), expected, atol=0.05, rtol=0.07)
    assert not torch.equal(layer(x), fp8_block_gemm(x, layer.weight, layer.weight_scale, block))


def test_without_w8a8_every_row_count_takes_w8a16() -> None:
    model, *_ = _load((32, 16, 16), 32, (16, 32))
    method = model.down_proj.quant_method
    assert method.prefill_gemm is None and method.crossover_key() is None
    x = torch.randn(80, 32)
    torch.testing.assert_close(method.route(x, kernel=False), method.route(x, kernel=True))


def test_the_crossover_is_measured_and_overridable(monkeypatch) -> None:
    """engine/layers/crossover.py sets the threshold of every W8A8-capable layer: measured
    (here by a timer in which the W8A16 route loses from 32 rows on) or
    $PAGEDSERVE_KERNEL_ROWS."""
    model, *_ = _load((32, 16, 16), 32, (16, 32), prefill_gemm=_w8a8())

    def timer(trial) -> float:
        return (2.0 if trial.rows >= 32 else 0.5) if trial.route == "kernel" else 1.0

    monkeypatch.delenv(KERNEL_ROWS_ENV, raising=False)
    chosen = plan_crossovers(model, torch.float32, torch.device("cpu"), timer, rows=(1, 16, 32))
    assert chosen == {"fp8-block 64x48 16x32": 16, "fp8-block 48x32 16x32": 16}
    assert model.down_proj.quant_method.max_kernel_rows == 16
    monkeypatch.setenv(KERNEL_ROWS_ENV, "100")
    plan_crossovers(model, torch.float32, torch.device("cpu"), timer, rows=(1, 16, 32))
    assert model.qkv_proj.quant_method.max_kernel_rows == 100


def test_which_devices_run_w8a8(monkeypatch) -> None:
    """FP8 tensor cores (sm_89+) and a block whose columns are a multiple of 32; the CPU
    (even forced to keep block FP8) and older GPUs: W8A16 only."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability["value"])
    assert block_fp8_w8a8_kernel(cuda, (128, 128)) is _w8a8()
    assert block_fp8_w8a8_kernel(cuda, (128, 64)) is _w8a8()
    assert block_fp8_w8a8_kernel(cuda, (32, 48)) is None  # K steps of 16 only
    capability["value"] = (8, 0)  # A100: no FP8 tensor cores
    assert block_fp8_w8a8_kernel(cuda, (128, 128)) is None
    assert block_fp8_w8a8_kernel(cpu, (128, 128)) is None
