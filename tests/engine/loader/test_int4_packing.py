"""The engine's AWQ / GPTQ decoding (engine/loader/int4_packing.py, int4_weights.py)
against tensors packed by the tests' own writer (tests/engine/int4_checkpoints.py), which
follows the formats' definitions: every layout, zero-point convention and act-order."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine.config.weights.int4_checkpoint import Int4Scheme
from engine.loader.int4_packing import (
    AWQ_ORDER,
    awq_to_int4,
    dequantize_int4,
    gptq_to_int4,
    pack_rows,
    unpack_columns,
    unpack_rows,
)
from engine.loader.int4_weights import int4_checkpoint_weights
from tests.engine.int4_checkpoints import (
    AWQ_NIBBLE_COLUMNS,
    pack_along_columns,
    pack_along_rows,
    write_int4_checkpoint,
)
from tests.model_utils import make_tiny_llama

CASES = {
    "awq-g128": dict(method="awq", group_size=128),
    "awq-g64": dict(method="awq", group_size=64),
    "gptq-sym-g128": dict(method="gptq", group_size=128, sym=True),
    "gptq-asym-g128": dict(method="gptq", group_size=128),
    "gptq-v2-asym": dict(method="gptq_v2", group_size=64),
    "gptq-act-order": dict(method="gptq", group_size=32, desc_act=True),
    "gptq-per-channel": dict(method="gptq", group_size=-1, sym=True),
}


def _scheme(method, group_size=128, sym=False, desc_act=False) -> Int4Scheme:
    if method == "awq":
        return Int4Scheme("awq", group_size, True, 0, False)
    return Int4Scheme("gptq", group_size, not sym, 1 if method == "gptq" else 0, desc_act)


def test_unpacking_inverts_the_writers_packing() -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (32, 24), generator=gen)
    assert torch.equal(unpack_rows(pack_along_rows(codes)).long(), codes)
    awq = pack_along_columns(codes, AWQ_NIBBLE_COLUMNS)
    assert tuple(AWQ_ORDER) == AWQ_NIBBLE_COLUMNS
    assert torch.equal(unpack_columns(awq, AWQ_ORDER).long(), codes)
    assert torch.equal(pack_rows(codes.to(torch.uint8)), pack_along_rows(codes))


def test_awq_nibble_order_is_interleaved() -> None:
    """Column 1 of eight sits in nibble 4 (bits 16-19), column 2 in nibble 1."""
    codes = torch.zeros(1, 8, dtype=torch.int64)
    codes[0, 1], codes[0, 2] = 3, 5
    word = pack_along_columns(codes, AWQ_NIBBLE_COLUMNS)[0, 0].item()
    assert word == (3 << 16) | (5 << 4)
    assert unpack_columns(torch.tensor([[word]], dtype=torch.int32), AWQ_ORDER)[0].tolist() == [
        0,
        3,
        5,
        0,
        0,
        0,
        0,
        0,
    ]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp32")
    return make_tiny_llama(path, hidden_size=128, intermediate_size=256, num_layers=1)


@pytest.mark.parametrize("case", CASES)
def test_dequantized_weights_equal_the_reference(case, tiny_llama, tmp_path) -> None:
    """Every projection streamed through the loader's INT4 reader comes out as exactly the
    reference's dequantized weight (the same fp32 arithmetic on the same codes)."""
    kwargs = CASES[case]
    quant_dir, ref_dir = write_int4_checkpoint(tiny_llama, tmp_path, **kwargs)
    scheme = _scheme(**kwargs)
    stream = load_file(quant_dir / "model.safetensors").items()
    ours = dict(int4_checkpoint_weights(stream, scheme, torch.float32))
    reference = load_file(ref_dir / "model.safetensors")
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name].float(), tensor, atol=0, rtol=0, msg=name)


def test_act_order_keeps_a_permutation(tiny_llama, tmp_path) -> None:
    quant_dir, ref_dir = write_int4_checkpoint(
        tiny_llama, tmp_path, "gptq", group_size=32, desc_act=True
    )
    tensors = load_file(quant_dir / "model.safetensors")
    prefix = "model.layers.0.mlp.down_proj"
    weight = gptq_to_int4(
        prefix,
        tensors[f"{prefix}.qweight"],
        tensors[f"{prefix}.qzeros"],
        tensors[f"{prefix}.scales"],
        tensors[f"{prefix}.g_idx"],
        _scheme("gptq", 32, desc_act=True),
    )
    assert weight.perm is not None and sorted(weight.perm.tolist()) == list(range(256))
    expected = load_file(ref_dir / "model.safetensors")[f"{prefix}.weight"]
    torch.testing.assert_close(dequantize_int4(weight, torch.float32), expected, atol=0, rtol=0)


def test_misshapen_tensors_are_named(tiny_llama, tmp_path) -> None:
    quant_dir, _ = write_int4_checkpoint(tiny_llama, tmp_path, "awq")
    tensors = load_file(quant_dir / "model.safetensors")
    prefix = "model.layers.0.self_attn.q_proj"
    scheme = _scheme("awq")
    with pytest.raises(ValueError, match=r"q_proj\.qzeros: expected int32 \[1, 16\]"):
        awq_to_int4(
            prefix,
            tensors[f"{prefix}.qweight"],
            tensors[f"{prefix}.qzeros"][:, :8],
            tensors[f"{prefix}.scales"],
            scheme,
        )
    with pytest.raises(ValueError, match="not a multiple of group_size 64"):
        awq_to_int4(
            prefix,
            tensors[f"{prefix}.qweight"][:96],
            tensors[f"{prefix}.qzeros"],
            tensors[f"{prefix}.scales"],
            Int4Scheme("awq", 64, True, 0, False),
        )
    stream = [(f"{prefix}.qweight", tensors[f"{prefix}.qweight"])]
    with pytest.raises(ValueError, match="lacks scales"):
        list(int4_checkpoint_weights(stream, scheme, torch.float32))


def test_unsorted_groups_of_unequal_size_are_refused(tiny_llama, tmp_path) -> None:
    quant_dir, _ = write_int4_checkpoint(tiny_llama, tmp_path, "gptq", group_size=64)
    tensors = load_file(quant_dir / "model.safetensors")
    prefix = "model.layers.0.mlp.down_proj"
    g_idx = tensors[f"{prefix}.g_idx"].clone()
    g_idx[0] = 1  # group 1 now holds 65 channels, group 0 only 63
    with pytest.raises(ValueError, match="g_idx: groups must each hold group_size=64"):
        gptq_to_int4(
            prefix,
            tensors[f"{prefix}.qweight"],
            tensors[f"{prefix}.qzeros"],
            tensors[f"{prefix}.scales"],
            g_idx,
            _scheme("gptq", 64),
        )


def test_symmetric_label_on_zero_point_weights_is_refused(tiny_llama, tmp_path) -> None:
    """A checkpoint with zero points but `sym: true` is refused, not decoded with z = 8."""
    quant_dir, _ = write_int4_checkpoint(tiny_llama, tmp_path, "gptq", group_size=64)
    tensors = load_file(quant_dir / "model.safetensors")
    prefix = "model.layers.0.mlp.up_proj"
    with pytest.raises(ValueError, match=r"up_proj\.qzeros: sym=true, but the stored zero"):
        gptq_to_int4(
            prefix,
            tensors[f"{prefix}.qweight"],
            tensors[f"{prefix}.qzeros"],
            tensors[f"{prefix}.scales"],
            tensors[f"{prefix}.g_idx"],
            _scheme("gptq", 64, sym=True),
        )
    with pytest.raises(ValueError, match=r"up_proj\.scales: expected fp16, bf16 or fp32"):
        gptq_to_int4(
            prefix,
            tensors[f"{prefix}.qweight"],
            tensors[f"{prefix}.qzeros"],
            tensors[f"{prefix}.scales"].to(torch.int32),
            tensors[f"{prefix}.g_idx"],
            _scheme("gptq", 64),
        )


def test_modules_kept_in_floats_pass_through(tiny_llama, tmp_path) -> None:
    """AWQ's `modules_to_not_convert`: a module stored as a float `.weight` beside INT4 ones
    reaches the loader untouched, and the INT4 modules are still decoded."""
    quant_dir, ref_dir = write_int4_checkpoint(tiny_llama, tmp_path, "awq")
    tensors = load_file(quant_dir / "model.safetensors")
    reference = load_file(ref_dir / "model.safetensors")
    prefix = "model.layers.0.self_attn.q_proj"
    for leaf in ("qweight", "qzeros", "scales"):
        del tensors[f"{prefix}.{leaf}"]
    float_weight = torch.randn(128, 128)
    tensors[f"{prefix}.weight"] = float_weight
    ours = dict(int4_checkpoint_weights(tensors.items(), _scheme("awq"), torch.float32))
    assert ours[f"{prefix}.weight"] is float_weight
    down = "model.layers.0.mlp.down_proj.weight"
    torch.testing.assert_close(ours[down], reference[down], atol=0, rtol=0)
