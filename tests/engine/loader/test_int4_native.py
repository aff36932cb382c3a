"""Symmetric GPTQ weights repacked into the native Q4_0 blocks (engine/loader/int4_native.py):
bit for bit the checkpoint's values; zero-point and act-order weights are refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine.config.weights.int4_checkpoint import Int4Scheme
from engine.loader.int4_native import fits_q4_0, int4_to_q4_0
from engine.loader.int4_packing import gptq_to_int4
from engine.native import native_kernels_available
from engine.native.quant import QType, quant_linear
from tests.engine.int4_checkpoints import write_int4_checkpoint
from tests.model_utils import make_tiny_llama

pytestmark = pytest.mark.skipif(not native_kernels_available(), reason="no C compiler")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp32")
    return make_tiny_llama(path, hidden_size=128, intermediate_size=256, num_layers=1)


def _weight(quant_dir, prefix, scheme):
    t = load_file(quant_dir / "model.safetensors")
    return gptq_to_int4(
        prefix,
        t[f"{prefix}.qweight"],
        t[f"{prefix}.qzeros"],
        t[f"{prefix}.scales"],
        t[f"{prefix}.g_idx"],
        scheme,
    )


@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_q4_0_blocks_hold_exactly_the_checkpoints_values(tiny_llama, tmp_path, group_size):
    quant_dir, ref_dir = write_int4_checkpoint(
        tiny_llama, tmp_path, "gptq", group_size=group_size, sym=True
    )
    scheme = Int4Scheme("gptq", group_size, False, 1, False)
    assert fits_q4_0(scheme)
    reference = load_file(ref_dir / "model.safetensors")
    for prefix in ("model.layers.0.mlp.down_proj", "model.layers.0.self_attn.k_proj"):
        blocks = int4_to_q4_0(prefix, _weight(quant_dir, prefix, scheme))
        assert blocks.qtype == QType.Q4_0
        expected = reference[f"{prefix}.weight"]
        torch.testing.assert_close(blocks.dequantize(), expected, atol=0, rtol=0)
        x = torch.randn(3, expected.shape[1], generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(quant_linear(x, blocks), x @ expected.T, atol=1e-4, rtol=1e-4)


def test_zero_points_and_act_order_do_not_fit(tiny_llama, tmp_path) -> None:
    assert not fits_q4_0(Int4Scheme("awq", 128, True, 0, False))
    assert not fits_q4_0(Int4Scheme("gptq", 128, False, 1, True))
    quant_dir, _ = write_int4_checkpoint(tiny_llama, tmp_path, "gptq", group_size=32)
    prefix = "model.layers.0.mlp.down_proj"
    asym = _weight(quant_dir, prefix, Int4Scheme("gptq", 32, True, 1, False))
    with pytest.raises(ValueError, match="zero points other than 8"):
        int4_to_q4_0(prefix, asym)
