"""Reading `quantization_config` (engine/config/checkpoint_quantization.py): the INT4
formats we serve become one scheme each; anything else is refused naming the field and
its value, before any weight is read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.config.checkpoint_quantization import (
    checkpoint_quantization,
    refuse_unserved_method,
    resolve_checkpoint_quantization,
    stays_quantized_on_cpu,
)
from engine.config.int4_checkpoint import Int4Scheme

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {
    "quant_method": "gptq",
    "bits": 4,
    "group_size": 128,
    "desc_act": False,
    "sym": True,
    "checkpoint_format": "gptq",
}


def _config(quantization: dict | None) -> SimpleNamespace:
    return SimpleNamespace(quantization_config=quantization)


def test_awq_and_gptq_schemes() -> None:
    assert checkpoint_quantization(_config(AWQ)) == Int4Scheme("awq", 128, True, 0, False)
    assert checkpoint_quantization(_config(GPTQ)) == Int4Scheme("gptq", 128, False, 1, False)
    asym_v2 = {**GPTQ, "sym": False, "desc_act": True, "checkpoint_format": "gptq_v2"}
    assert checkpoint_quantization(_config(asym_v2)) == Int4Scheme("gptq", 128, True, 0, True)
    per_channel = {**GPTQ, "group_size": -1}
    assert checkpoint_quantization(_config(per_channel)).group_size == -1
    # AutoAWQ's own spelling: upper-case version, w_bit / q_group_size.
    autoawq = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "version": "GEMM"}
    assert checkpoint_quantization(_config(autoawq)) == Int4Scheme("awq", 64, True, 0, False)
    assert checkpoint_quantization(_config(None)) is None


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
def test_unserved_settings_are_refused_naming_the_field(quantization, field) -> None:
    with pytest.raises(ValueError, match="not served") as error:
        checkpoint_quantization(_config(quantization))
    assert field in str(error.value)


def test_unknown_method_is_refused_when_the_model_is_built() -> None:
    config = _config({"quant_method": "bitsandbytes", "load_in_4bit": True})
    assert checkpoint_quantization(config) is None  # left to the family's check first
    with pytest.raises(NotImplementedError, match="quant_method='bitsandbytes' is not served"):
        refuse_unserved_method(config)
    refuse_unserved_method(_config({"quant_method": "mxfp4"}))  # GPT-OSS reads it itself
    refuse_unserved_method(_config(AWQ))


def test_requested_quantization_must_agree_with_the_checkpoint() -> None:
    assert resolve_checkpoint_quantization("auto", _config(AWQ)) == "awq"
    assert resolve_checkpoint_quantization("gptq", _config(GPTQ)) == "gptq"
    assert resolve_checkpoint_quantization("auto", _config(None)) is None
    assert resolve_checkpoint_quantization("int8", _config(None)) is None
    with pytest.raises(ValueError, match=r"quant_method='awq'.*got 'int8'"):
        resolve_checkpoint_quantization("int8", _config(AWQ))
    with pytest.raises(ValueError, match=r"quant_method='awq'.*got None"):
        resolve_checkpoint_quantization(None, _config(AWQ))
    with pytest.raises(ValueError, match="quantization='gptq' needs a checkpoint"):
        resolve_checkpoint_quantization("gptq", _config(None))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        resolve_checkpoint_quantization("auto", _config(AWQ), world_size=2)


def test_only_symmetric_gptq_without_act_order_stays_quantized_on_cpu() -> None:
    assert stays_quantized_on_cpu(_config(GPTQ))
    assert stays_quantized_on_cpu(_config({**GPTQ, "group_size": -1}))
    assert not stays_quantized_on_cpu(_config({**GPTQ, "desc_act": True}))
    assert not stays_quantized_on_cpu(_config({**GPTQ, "sym": False}))
    assert not stays_quantized_on_cpu(_config(AWQ))
    assert not stays_quantized_on_cpu(_config(None))
