"""compressed-tensors `pack-quantized` INT4 decoding (engine/loader/ct_int4_packing.py)
against the package's own compressor and decompression (tests/engine/ct_int4_checkpoints.py):
bit for bit for symmetric and asymmetric, group and channel, act-order, every scale dtype and
odd output sizes; misshapen tensors refused naming them; the streamed checkpoint; the exact
Q4_0 repacking of bf16 scales."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine.config.weights.int4_checkpoint import Int4Scheme
from engine.loader.ct_int4_packing import compressed_tensors_to_int4
from engine.loader.int4_native import int4_to_q4_0
from engine.loader.int4_packing import dequantize_int4
from engine.loader.int4_weights import int4_checkpoint_weights
from engine.native import native_kernels_available
from tests.engine.ct_int4_checkpoints import (
    CT_MISSING,
    compress_weight,
    quantization_args,
    write_ct_int4_checkpoint,
)
from tests.model_utils import make_tiny_llama

pytest.importorskip("compressed_tensors", reason=CT_MISSING)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (symmetric, group_size, act-order, [out, in]): odd output sizes leave a zero point word
# partly filled; channel groups take any multiple of 8 inputs.
CASES = {
    "sym-g128": (True, 128, False, (20, 256)),
    "asym-g128": (False, 128, False, (36, 256)),
    "sym-g32-act-order": (True, 32, True, (24, 96)),
    "asym-g64-act-order": (False, 64, True, (13, 192)),
    "sym-channel": (True, -1, False, (20, 40)),
    "asym-channel": (False, -1, False, (9, 72)),
}


def _scheme(symmetric: bool, group_size: int, act_order: bool = False, ignore=()) -> Int4Scheme:
    return Int4Scheme("compressed-tensors", group_size, not symmetric, 0, act_order, ignore)


def _decode(name: str, tensors: dict, scheme: Int4Scheme):
    return compressed_tensors_to_int4(
        name,
        tensors["weight_packed"],
        tensors["weight_scale"],
        tensors["weight_shape"],
        tensors.get("weight_zero_point"),
        tensors.get("weight_g_idx"),
        scheme,
    )


def _compressed(case: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    symmetric, group_size, act_order, (n, k) = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    perm = torch.randperm(k, generator=gen) if act_order else None
    args = quantization_args(symmetric, group_size)
    tensors, reference = compress_weight(weight, args, perm)
    return tensors, reference, weight, _scheme(symmetric, group_size, act_order)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_decoding_equals_the_packages_decompression_bit_for_bit(case, dtype) -> None:
    tensors, reference, weight, scheme = _compressed(case, DTYPES[dtype])
    decoded = _decode("m", tensors, scheme)
    assert decoded.scales.dtype == DTYPES[dtype]
    assert (decoded.perm is not None) == scheme.desc_act
    assert torch.equal(dequantize_int4(decoded, DTYPES[dtype]), reference)
    # ... and the numbers are the weight's to 4 bits (not, say, another column's)
    error = (reference.float() - weight.float()).abs().amax()
    assert error < 0.35 * weight.float().abs().amax()


def test_an_unset_g_idx_reads_in_column_order() -> None:
    """A g_idx holding -1 was never set by calibration; the package reads columns in order."""
    tensors, reference, _, scheme = _compressed("asym-g128")
    tensors["weight_g_idx"] = torch.full((256,), -1, dtype=torch.int32)
    assert torch.equal(dequantize_int4(_decode("m", tensors, scheme), torch.bfloat16), reference)


@pytest.mark.parametrize("case", ["asym-g64-act-order", "sym-channel"])
def test_fp32_decoding_is_exact(case) -> None:
    """In fp32 the decoded weight is (q - zp) s unrounded: the package's decompression with
    its scales upcast first."""
    symmetric, group_size, act_order, (n, k) = CASES[case]
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(n, k, generator=gen) * 0.1).to(torch.bfloat16)
    perm = torch.randperm(k, generator=gen) if act_order else None
    args = quantization_args(symmetric, group_size)
    tensors, exact = compress_weight(weight, args, perm, exact=True)
    assert exact.dtype == torch.float32
    decoded = _decode("m", tensors, _scheme(symmetric, group_size, act_order))
    assert torch.equal(dequantize_int4(decoded, torch.float32), exact)


REFUSED = {
    "weight_shape": (lambda t: t.update(weight_shape=torch.tensor([36, 250])), "weight_shape"),
    "weight_packed": (
        lambda t: t.update(weight_packed=t["weight_packed"][:, :-1]),
        "weight_packed",
    ),
    "weight_scale": (lambda t: t.update(weight_scale=t["weight_scale"][:, :1]), "weight_scale"),
    "missing zero point": (lambda t: t.pop("weight_zero_point"), "weight_zero_point is missing"),
    "zero point rows": (
        lambda t: t.update(weight_zero_point=t["weight_zero_point"][:-1]),
        "weight_zero_point: expected int32 [5, 2]",
    ),
    "unequal groups": (
        lambda t: t.update(weight_g_idx=torch.arange(256, dtype=torch.int32) % 3 % 2),
        "weight_g_idx: groups must each hold group_size=128",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_misshapen_tensors_are_refused_naming_them(case) -> None:
    tensors, _, _, scheme = _compressed("asym-g128")
    edit, named = REFUSED[case]
    edit(tensors)
    with pytest.raises(ValueError, match="m\\." + named.replace("[", "\\[")):
        _decode("m", tensors, scheme)


def test_what_int4_cannot_hold_is_refused() -> None:
    # an input size the packing allows (channel) but our INT4 layout does not
    weight = torch.randn(8, 36, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    tensors, _ = compress_weight(weight, quantization_args(True, -1))
    with pytest.raises(ValueError, match=r"m\.weight_shape: \(8, 36\).*multiple of 8"):
        _decode("m", tensors, _scheme(True, -1))
    tensors, _, _, scheme = _compressed("sym-g32-act-order")
    tensors.pop("weight_g_idx")
    with pytest.raises(ValueError, match=r"m\.weight_g_idx is missing"):
        _decode("m", tensors, scheme)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("src")
    return make_tiny_llama(path, hidden_size=128, intermediate_size=256, num_layers=1)


@pytest.mark.parametrize(
    "kwargs", [dict(), dict(symmetric=False, group_size=64, act_order=True)], ids=["sym", "asym"]
)
def test_the_streamed_checkpoint_decodes_to_the_reference(tiny_llama, tmp_path, kwargs) -> None:
    """Parts in any order (reversed here); every projection replaced by its exact weight."""
    quant_dir, ref_dir = write_ct_int4_checkpoint(tiny_llama, tmp_path, **kwargs)
    scheme = _scheme(
        kwargs.get("symmetric", True), kwargs.get("group_size", 128), kwargs.get("act_order", False)
    )
    stream = reversed(list(load_file(quant_dir / "model.safetensors").items()))
    loaded = dict(int4_checkpoint_weights(stream, scheme, torch.float32))
    reference = load_file(ref_dir / "model.safetensors")
    assert loaded.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(loaded[name].float(), tensor), name


def test_a_packed_module_the_config_ignores_is_refused(tiny_llama, tmp_path) -> None:
    quant_dir, _ = write_ct_int4_checkpoint(tiny_llama, tmp_path)
    scheme = _scheme(True, 128, ignore=("re:.*mlp.down_proj$",))
    stream = load_file(quant_dir / "model.safetensors").items()
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.down_proj' is stored packed"):
        dict(int4_checkpoint_weights(stream, scheme, torch.float32))


@pytest.mark.skipif(not native_kernels_available(), reason="no C compiler")
def test_bf16_scales_repack_into_q4_0_exactly_where_fp16_holds_them() -> None:
    tensors, _, _, scheme = _compressed("sym-g128")
    decoded = _decode("m", tensors, scheme)
    blocks = int4_to_q4_0("m", decoded)
    assert torch.equal(blocks.dequantize(), dequantize_int4(decoded, torch.float32))
    decoded.scales[0, 0] = 1e-9  # below fp16's smallest subnormal
    with pytest.raises(ValueError, match="m: bfloat16 scales that fp16 cannot hold exactly"):
        int4_to_q4_0("m", decoded)
