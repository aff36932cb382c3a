"""Block-scaled FP8 configs: transformers' `quant_method: "fp8"` (as Qwen3-*-FP8 and
DeepSeek-V3 publish it) and compressed-tensors' `block` strategy (as llm-compressor's
FP8_BLOCK writes it) parse to a "block" `Fp8Scheme`; every variant not served is refused
with the field and value named."""

from __future__ import annotations

import copy

import pytest

from engine.config.weights.checkpoint_quantization import (
    parse_quantization_config,
    read_checkpoint_quantization,
)
from engine.config.weights.fp8_checkpoint import Fp8Scheme

# Qwen/Qwen3-8B-FP8's config.json quantization_config
QWEN3_FP8 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
# deepseek-ai/DeepSeek-V3.1's (V3 / R1 have no scale_fmt: fp32 scales)
DEEPSEEK_V31 = {**QWEN3_FP8, "scale_fmt": "ue8m0"}
# What compressed-tensors 0.20 writes for llm-compressor's FP8_BLOCK preset
CT_FP8_BLOCK = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "format": "float-quantized",
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "block", "symmetric": True,
                        "dynamic": False, "group_size": None, "block_structure": [128, 128]},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                  "symmetric": True, "dynamic": True, "group_size": 128},
            "output_activations": None,
        }
    },
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
}  # fmt: skip


class _Config:
    def __init__(self, quantization_config, architectures=("LlamaForCausalLM",)):
        self.quantization_config = quantization_config
        self.architectures = list(architectures)


def test_transformers_block_fp8() -> None:
    found = parse_quantization_config(QWEN3_FP8)
    assert (found.quant_method, found.method) == ("fp8", "fp8")
    assert found.scheme == Fp8Scheme("block", "dynamic", (), False, (128, 128))
    ue8m0 = parse_quantization_config({**DEEPSEEK_V31, "modules_to_not_convert": ["lm_head"]})
    assert ue8m0.scheme == Fp8Scheme("block", "dynamic", ("lm_head",), False, (128, 128))
    # the optional fields left out take transformers' defaults; MiniMax's name for the list
    bare = parse_quantization_config(
        {"quant_method": "fp8", "weight_block_size": [64, 32], "ignored_layers": ["gate"]}
    )
    assert bare.scheme == Fp8Scheme("block", "dynamic", ("gate",), False, (64, 32))


def test_deepseek_v3_reads_its_block_fp8_through_the_table(tmp_path) -> None:
    found = read_checkpoint_quantization(tmp_path, _Config(QWEN3_FP8, ["DeepseekV3ForCausalLM"]))
    assert found.scheme.weight_strategy == "block"


def test_transformers_config_object_is_read(tmp_path) -> None:
    from transformers import FineGrainedFP8Config

    config = FineGrainedFP8Config(weight_block_size=[128, 128], modules_to_not_convert=["lm_head"])
    found = read_checkpoint_quantization(tmp_path, _Config(config))
    assert found.scheme == Fp8Scheme("block", "dynamic", ("lm_head",), False, (128, 128))


def test_compressed_tensors_block() -> None:
    found = parse_quantization_config(CT_FP8_BLOCK)
    assert (found.quant_method, found.method) == ("compressed-tensors", "fp8")
    assert found.scheme == Fp8Scheme("block", "dynamic", ("lm_head",), False, (128, 128))
    per_token = copy.deepcopy(CT_FP8_BLOCK)
    per_token["config_groups"]["group_0"]["input_activations"].update(strategy="token")
    assert parse_quantization_config(per_token).scheme.block_size == (128, 128)
    weight_only = copy.deepcopy(CT_FP8_BLOCK)
    weight_only["config_groups"]["group_0"]["input_activations"] = None
    assert parse_quantization_config(weight_only).scheme.activation_scheme == "none"


def _ct(section: str, **fields):
    config = copy.deepcopy(CT_FP8_BLOCK)
    config["config_groups"]["group_0"][section].update(fields)
    return config


REFUSED = {
    "e5m2": ({**QWEN3_FP8, "fmt": "e5m2"}, "fmt='e5m2'"),
    "static activations": ({**QWEN3_FP8, "activation_scheme": "static"}, "activation_scheme="),
    "per-tensor fp8": ({**QWEN3_FP8, "weight_block_size": None}, "weight_block_size=None"),
    "one block size": ({**QWEN3_FP8, "weight_block_size": [128]}, "weight_block_size=[128]"),
    "zero block": ({**QWEN3_FP8, "weight_block_size": [0, 128]}, "weight_block_size=[0, 128]"),
    "other scale format": ({**QWEN3_FP8, "scale_fmt": "e4m3"}, "scale_fmt='e4m3'"),
    "fp4 experts": ({**QWEN3_FP8, "expert_dtype": "fp4"}, "expert_dtype='fp4'"),
    "fp8 embeddings": (
        {**QWEN3_FP8, "modules_to_convert": ["embed_tokens"]},
        "modules_to_convert=['embed_tokens']",
    ),
    "ct block without shape": (_ct("weights", block_structure=None), "block_structure=None"),
    "ct block 3d": (_ct("weights", block_structure=[1, 2, 3]), "block_structure=[1, 2, 3]"),
    "ct block static activations": (
        _ct("input_activations", dynamic=False, strategy="tensor"),
        "input_activations.dynamic=False",
    ),
    "ct block per-channel activations": (
        _ct("input_activations", strategy="channel"),
        "input_activations.strategy='channel'",
    ),
    "ct group activations, channel weights": (
        _ct("weights", strategy="channel", block_structure=None),
        "input_activations.strategy='group'",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unserved_block_configs_are_refused_naming_the_field(case) -> None:
    config, named = REFUSED[case]
    with pytest.raises(ValueError) as error:
        parse_quantization_config(config)
    assert named in str(error.value)
