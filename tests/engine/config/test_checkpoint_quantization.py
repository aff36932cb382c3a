"""The quantization_config dispatch: what each FP8 format parses to, and every config we do
not serve refused at load with the field and value named."""

from __future__ import annotations

import copy
import json

import pytest

from engine import LLM
from engine.config.weights.checkpoint_quantization import (
    read_checkpoint_quantization,
    resolve_checkpoint_quantization,
)
from engine.config.weights.fp8_checkpoint import Fp8Scheme, is_ignored
from tests.engine.fp8_checkpoints import make_compressed_tensors_fp8, make_modelopt_fp8


class _Config:
    def __init__(self, quantization_config=None):
        if quantization_config is not None:
            self.quantization_config = quantization_config


# A compressed-tensors FP8_DYNAMIC config as llm-compressor writes it (RedHatAI's checkpoints).
CT_DYNAMIC = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                        "symmetric": True, "dynamic": False, "group_size": None},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "symmetric": True, "dynamic": True, "group_size": None},
            "output_activations": None,
        }
    },
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
}  # fmt: skip


def _parse(config, tmp_path):
    return read_checkpoint_quantization(tmp_path, _Config(config))


def test_compressed_tensors_dynamic_per_channel(tmp_path) -> None:
    found = _parse(CT_DYNAMIC, tmp_path)
    assert (found.quant_method, found.method) == ("compressed-tensors", "fp8")
    assert found.scheme == Fp8Scheme("channel", "dynamic", ("lm_head",), False)


def test_what_the_compressed_tensors_package_writes_parses(tmp_path) -> None:
    for scheme, expected in (
        ("FP8_DYNAMIC", ("channel", "dynamic")),
        ("FP8", ("tensor", "static")),
    ):
        path = make_compressed_tensors_fp8(tmp_path / scheme, scheme)
        config = json.loads((path / "config.json").read_text())["quantization_config"]
        found = read_checkpoint_quantization(path, _Config(config))
        assert (found.scheme.weight_strategy, found.scheme.activation_scheme) == expected
        assert found.scheme.ignore == ("lm_head",)


def test_modelopt_from_config_json_and_from_hf_quant_config(tmp_path) -> None:
    path, _ = make_modelopt_fp8(tmp_path / "fp8", tmp_path / "ref")
    config = json.loads((path / "config.json").read_text())
    from_config = read_checkpoint_quantization(path, _Config(config["quantization_config"]))
    from_sidecar = read_checkpoint_quantization(path, _Config())  # hf_quant_config.json only
    expected = Fp8Scheme("tensor", "static", ("lm_head",), True)
    assert from_config.scheme == from_sidecar.scheme == expected
    assert from_sidecar.quant_method == "modelopt"


def test_unquantized_checkpoint_has_none(tmp_path) -> None:
    assert read_checkpoint_quantization(tmp_path, _Config()) is None
    # GPT-OSS's MXFP4 experts are its family's to read (engine/models/gpt_oss.py)
    gpt_oss = _Config({"quant_method": "mxfp4"})
    gpt_oss.architectures = ["GptOssForCausalLM"]
    assert read_checkpoint_quantization(tmp_path, gpt_oss) is None


def _edited(path: tuple, value):
    config = copy.deepcopy(CT_DYNAMIC)
    target = config
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return config


G = ("config_groups", "group_0")
REFUSED = {
    "int4 weights": (_edited((*G, "weights", "num_bits"), 4), "weights.num_bits=4"),
    "int weights": (_edited((*G, "weights", "type"), "int"), "weights.type='int'"),
    "group strategy": (_edited((*G, "weights", "strategy"), "group"), "weights.strategy='group'"),
    # block weights are served (test_block_fp8_config.py), but not without their block shape
    "block without a shape": (
        _edited((*G, "weights", "strategy"), "block"),
        "weights.block_structure=None",
    ),
    "asymmetric": (_edited((*G, "weights", "symmetric"), False), "weights.symmetric=False"),
    "per-group activations": (
        _edited((*G, "input_activations", "strategy"), "group"),
        "input_activations.strategy='group'",
    ),
    "static per-token activations": (
        _edited((*G, "input_activations", "dynamic"), False),
        "input_activations.strategy='token'",
    ),
    "4-bit activations": (
        _edited((*G, "input_activations", "num_bits"), 4),
        "input_activations.num_bits=4",
    ),
    "packed int format": (_edited(("format",), "pack-quantized"), "format='pack-quantized'"),
    "other targets": (_edited((*G, "targets"), ["re:.*mlp.*"]), "targets=['re:.*mlp.*']"),
    "unknown method": (_edited(("quant_method",), "bitsandbytes"), "quant_method='bitsandbytes'"),
    "int8 kv cache": (
        _edited(("kv_cache_scheme",), {"num_bits": 8, "type": "int", "strategy": "tensor"}),
        "kv_cache_scheme.type='int'",
    ),
    "modelopt nvfp4": ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo='NVFP4'"),
    "modelopt int8 kv": (
        {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "INT8"},
        "kv_cache_quant_algo='INT8'",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unserved_configs_are_refused_naming_the_field(case, tmp_path) -> None:
    config, named = REFUSED[case]
    with pytest.raises(ValueError) as error:
        _parse(config, tmp_path)
    assert named in str(error.value)


def test_another_method_on_a_quantized_checkpoint_is_refused(tmp_path) -> None:
    found = _parse(CT_DYNAMIC, tmp_path)
    for requested in (None, "auto", "none", "fp8", "compressed-tensors"):
        assert resolve_checkpoint_quantization(requested, found) == "fp8"
    with pytest.raises(ValueError, match=r"quantization='int8'.*already quantized"):
        resolve_checkpoint_quantization("int8", found)


def test_ignore_patterns() -> None:
    assert is_ignored("lm_head", ("lm_head",))
    assert is_ignored("model.layers.0.mlp.gate", ("re:.*mlp.gate$",))
    assert is_ignored("model.layers.3.mlp.gate", ("model.layers.*.mlp.gate",))
    assert not is_ignored("model.layers.0.mlp.gate_proj", ("re:.*mlp.gate$", "lm_head"))


def test_the_engine_refuses_an_unserved_checkpoint_at_load(tmp_path) -> None:
    path = make_compressed_tensors_fp8(tmp_path / "fp8", "FP8_DYNAMIC", max_position_embeddings=64)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "group"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weights\.strategy='group' is not served"):
        LLM(model=str(path), max_model_len=64)
