"""Reading an INT4 `quantization_config` (engine/config/weights/checkpoint_quantization.py's table,
engine/config/weights/int4_checkpoint.py's parsers): the AWQ and GPTQ formats we serve become one
scheme each; anything else is refused naming the field and its value, before any weight is
read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.config.weights.checkpoint_quantization import (
    read_checkpoint_quantization,
    resolve_checkpoint_quantization,
    stays_quantized_on_cpu,
)
from engine.config.weights.int4_checkpoint import Int4Scheme

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {
    "quant_method": "gptq",
    "bits": 4,
    "group_size": 128,
    "desc_act": False,
    "sym": True,
    "checkpoint_format": "gptq",
}


def _found(quantization: dict | None, tmp_path):
    return read_checkpoint_quantization(tmp_path, SimpleNamespace(quantization_config=quantization))


def _scheme(quantization: dict | None, tmp_path):
    found = _found(quantization, tmp_path)
    return None if found is None else found.scheme


def test_awq_and_gptq_schemes(tmp_path) -> None:
    assert _scheme(AWQ, tmp_path) == Int4Scheme("awq", 128, True, 0, False)
    assert _scheme(GPTQ, tmp_path) == Int4Scheme("gptq", 128, False, 1, False)
    asym_v2 = {**GPTQ, "sym": False, "desc_act": True, "checkpoint_format": "gptq_v2"}
    assert _scheme(asym_v2, tmp_path) == Int4Scheme("gptq", 128, True, 0, True)
    assert _scheme({**GPTQ, "group_size": -1}, tmp_path).group_size == -1
    # AutoAWQ's own spelling: upper-case version, w_bit / q_group_size.
    autoawq = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "version": "GEMM"}
    assert _scheme(autoawq, tmp_path) == Int4Scheme("awq", 64, True, 0, False)
    assert _found(None, tmp_path) is None
    assert (_found(AWQ, tmp_path).quant_method, _found(AWQ, tmp_path).method) == ("awq", "awq")


@pytest.mark.parametrize(
    ("quantization", "field"),
    [
        ({**GPTQ, "bits": 3}, "bits=3"),
        ({**GPTQ, "bits": 8}, "bits=8"),
        ({**AWQ, "group_size": 256}, "group_size=256"),
        ({**AWQ, "version": "gemv"}, "version='gemv'"),
        ({**AWQ, "version": "exllama"}, "version='exllama'"),
        ({**AWQ, "zero_point": False}, "zero_point=False"),
        ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
        ({**GPTQ, "lm_head": True}, "lm_head=True"),
        ({**GPTQ, "dynamic": {"-:.*down_proj": {}}}, "dynamic="),
    ],
)
def test_unserved_settings_are_refused_naming_the_field(quantization, field, tmp_path) -> None:
    with pytest.raises(ValueError, match="not served") as error:
        _found(quantization, tmp_path)
    assert field in str(error.value)


def test_unknown_method_is_refused_naming_it(tmp_path) -> None:
    with pytest.raises(ValueError, match="quant_method='bitsandbytes' is not served"):
        _found({"quant_method": "bitsandbytes", "load_in_4bit": True}, tmp_path)
    # GPT-OSS reads its own MXFP4 config: passed over by the table
    gpt_oss = SimpleNamespace(
        quantization_config={"quant_method": "mxfp4"}, architectures=["GptOssForCausalLM"]
    )
    assert read_checkpoint_quantization(tmp_path, gpt_oss) is None


def test_requested_quantization_must_agree_with_the_checkpoint(tmp_path) -> None:
    awq, gptq = _found(AWQ, tmp_path), _found(GPTQ, tmp_path)
    assert resolve_checkpoint_quantization("auto", awq) == "awq"
    assert resolve_checkpoint_quantization(None, awq) == "awq"  # vLLM: None reads the config
    assert resolve_checkpoint_quantization("gptq", gptq) == "gptq"
    assert resolve_checkpoint_quantization("auto", None) is None
    assert resolve_checkpoint_quantization("int8", None) is None
    with pytest.raises(ValueError, match=r"quantization='int8'.*quant_method='awq'"):
        resolve_checkpoint_quantization("int8", awq)
    with pytest.raises(ValueError, match="quantization='gptq' needs a checkpoint stored that way"):
        resolve_checkpoint_quantization("gptq", None)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        resolve_checkpoint_quantization("auto", awq, world_size=2)


def test_only_symmetric_gptq_without_act_order_stays_quantized_on_cpu(tmp_path) -> None:
    assert stays_quantized_on_cpu(_found(GPTQ, tmp_path))
    assert stays_quantized_on_cpu(_found({**GPTQ, "group_size": -1}, tmp_path))
    assert not stays_quantized_on_cpu(_found({**GPTQ, "desc_act": True}, tmp_path))
    assert not stays_quantized_on_cpu(_found({**GPTQ, "sym": False}, tmp_path))
    assert not stays_quantized_on_cpu(_found(AWQ, tmp_path))
    assert not stays_quantized_on_cpu(None)
