"""compressed-tensors configs routed by `format` (engine/config/weights/ct_int4_checkpoint.py):
`pack-quantized` 4-bit int weights become one `Int4Scheme`, `float-quantized` stays FP8, and
everything else is refused naming the field and value, before any weight is read."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest

from engine.config.weights.checkpoint_quantization import (
    read_checkpoint_quantization,
    resolve_checkpoint_quantization,
    stays_quantized_on_cpu,
)
from engine.config.weights.int4_checkpoint import Int4Scheme
from tests.engine.ct_int4_checkpoints import write_ct_int4_checkpoint
from tests.model_utils import make_tiny_llama

# llm-compressor's W4A16 as RedHatAI's *-quantized.w4a16 checkpoints carry it.
W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": 128, "dynamic": False, "actorder": "weight",
                        "observer": "minmax", "observer_kwargs": {}, "block_structure": None},
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }
    },
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "sparsity_config": {},
    "transform_config": {},
}  # fmt: skip
W = ("config_groups", "group_0", "weights")


def _edited(*edits):
    config = copy.deepcopy(W4A16)
    for path, value in edits:
        target = config
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return config


def _found(config, tmp_path):
    return read_checkpoint_quantization(tmp_path, SimpleNamespace(quantization_config=config))


def test_w4a16_variants(tmp_path) -> None:
    found = _found(W4A16, tmp_path)
    assert (found.quant_method, found.method) == ("compressed-tensors", "compressed-tensors")
    assert found.scheme == Int4Scheme("compressed-tensors", 128, False, 0, False, ("lm_head",))
    asym = _found(_edited(((*W, "symmetric"), False), ((*W, "group_size"), 64)), tmp_path)
    assert (asym.scheme.group_size, asym.scheme.zero_point) == (64, True)
    channel = _edited(((*W, "strategy"), "channel"), ((*W, "group_size"), None))
    assert _found(channel, tmp_path).scheme.group_size == -1
    for actorder, g_idx in (("group", True), ("dynamic", True), (None, False), ("static", False)):
        scheme = _found(_edited(((*W, "actorder"), actorder)), tmp_path).scheme
        assert scheme.desc_act is g_idx, actorder
    # the format given per group only, as older configs do
    no_top = _edited((("format",), None))
    assert _found(no_top, tmp_path).method == "compressed-tensors"


def test_what_the_package_writes_parses(tmp_path) -> None:
    model = make_tiny_llama(tmp_path / "src", hidden_size=64, num_layers=1)
    quant_dir, _ = write_ct_int4_checkpoint(model, tmp_path / "w4a16", group_size=64)
    config = json.loads((quant_dir / "config.json").read_text())["quantization_config"]
    expected = Int4Scheme("compressed-tensors", 64, False, 0, False, ("lm_head",))
    assert _found(config, tmp_path).scheme == expected
    kwargs = dict(symmetric=False, group_size=32, act_order=True)
    quant_dir, _ = write_ct_int4_checkpoint(model, tmp_path / "asym", **kwargs)
    config = json.loads((quant_dir / "config.json").read_text())["quantization_config"]
    scheme = _found(config, tmp_path).scheme
    assert (scheme.group_size, scheme.zero_point, scheme.desc_act) == (32, True, True)


REFUSED = {
    "W8A16": (_edited(((*W, "num_bits"), 8)), "weights.num_bits=8"),
    "float weights": (_edited(((*W, "type"), "float")), "weights.type='float'"),
    "int-quantized W8A8": (
        _edited((("format",), "int-quantized"), (("config_groups", "group_0", "format"), None)),
        "format='int-quantized'",
    ),
    "naive-quantized": (
        _edited((("format",), "naive-quantized"), (("config_groups", "group_0", "format"), None)),
        "format='naive-quantized'",
    ),
    "tensor strategy": (_edited(((*W, "strategy"), "tensor")), "weights.strategy='tensor'"),
    "block strategy": (_edited(((*W, "strategy"), "block")), "weights.strategy='block'"),
    "group size 256": (_edited(((*W, "group_size"), 256)), "weights.group_size=256"),
    "channel with a group": (
        _edited(((*W, "strategy"), "channel")),
        "weights.group_size=128",
    ),
    "dynamic": (_edited(((*W, "dynamic"), True)), "weights.dynamic=True"),
    "unknown actorder": (_edited(((*W, "actorder"), "sorted")), "weights.actorder='sorted'"),
    "input activations": (
        _edited((("config_groups", "group_0", "input_activations"), {"num_bits": 8})),
        "input_activations={'num_bits': 8}",
    ),
    "targets": (
        _edited((("config_groups", "group_0", "targets"), ["re:.*mlp.*"])),
        "targets=['re:.*mlp.*']",
    ),
    "kv cache": (_edited((("kv_cache_scheme",), {"num_bits": 8})), "kv_cache_scheme="),
    "2:4 sparsity": (_edited((("sparsity_config",), {"format": "sparse-24"})), "sparsity_config="),
    "not compressed": (_edited((("quantization_status",), "frozen")), "quantization_status="),
    "transforms": (_edited((("transform_config",), {"config_groups": {}})), "transform_config="),
}


def _two_groups():
    config = copy.deepcopy(W4A16)
    second = copy.deepcopy(config["config_groups"]["group_0"])
    second["weights"]["group_size"] = 64
    config["config_groups"]["group_1"] = second
    return config


REFUSED["mixed groups"] = (_two_groups(), "config_groups=['group_0', 'group_1']")
_mixed = _two_groups()
_mixed["config_groups"]["group_1"]["format"] = "float-quantized"
REFUSED["mixed formats"] = (_mixed, "format=['float-quantized', 'pack-quantized']")


@pytest.mark.parametrize("case", REFUSED)
def test_unserved_configs_are_refused_naming_the_field(case, tmp_path) -> None:
    config, named = REFUSED[case]
    with pytest.raises(ValueError, match="is not served") as error:
        _found(config, tmp_path)
    assert named in str(error.value)


def test_requested_quantization_and_cpu_dtype(tmp_path) -> None:
    found = _found(W4A16, tmp_path)
    for requested in (None, "auto", "compressed-tensors"):
        assert resolve_checkpoint_quantization(requested, found) == "compressed-tensors"
    with pytest.raises(ValueError, match=r"quantization='fp8'.*already quantized"):
        resolve_checkpoint_quantization("fp8", found)
    with pytest.raises(ValueError, match="needs a checkpoint stored that way"):
        resolve_checkpoint_quantization("compressed-tensors", None)
    # symmetric without act-order stays in Q4_0 blocks on the CPU (so fp32 under "auto")
    assert stays_quantized_on_cpu(found)
    assert not stays_quantized_on_cpu(_found(_edited(((*W, "symmetric"), False)), tmp_path))
    assert not stays_quantized_on_cpu(_found(_edited(((*W, "actorder"), "group")), tmp_path))
