"""EngineArgs `batch_invariant`: the flag reaches EngineArgs, and the combinations whose
reductions would depend on the batch again are refused by name when the config is made."""

from __future__ import annotations

import pytest

from engine.config.batch_invariant import check_batch_invariant
from services.cli.flags import build_parser, engine_args_from

SUPPORTED = dict(
    device="cpu", dtype="float32", attention_backend=None, world_size=1, speculative=False,
    lora=False,
)  # fmt: skip


@pytest.mark.parametrize("command", ["engine", "serve"])
def test_the_flag_sets_engine_args(command):
    assert engine_args_from(
        build_parser().parse_args([command, "--batch-invariant"])
    ).batch_invariant
    assert not engine_args_from(build_parser().parse_args([command])).batch_invariant


def test_cpu_float32_is_supported():
    check_batch_invariant(**SUPPORTED)
    check_batch_invariant(**{**SUPPORTED, "attention_backend": "cpu"})
    # the GPU's kernels in Triton's interpreter (how the tests run them on a CPU)
    check_batch_invariant(**{**SUPPORTED, "attention_backend": "triton"})


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
@pytest.mark.parametrize("backend", [None, "triton"])
def test_a_gpu_with_the_triton_backend_is_supported(device, dtype, backend):
    check_batch_invariant(
        **{**SUPPORTED, "device": device, "dtype": dtype, "attention_backend": backend}
    )


@pytest.mark.parametrize(
    "change, named",
    [
        ({"device": "mps"}, "device 'mps'"),
        ({"device": "cuda", "attention_backend": "torch"}, "attention_backend 'torch' on a GPU"),
        ({"attention_backend": "triton", "dtype": "float16"}, "dtype 'float16'"),
        ({"dtype": "bfloat16"}, "dtype 'bfloat16'"),
        ({"attention_backend": "torch"}, "attention_backend 'torch'"),
        ({"world_size": 2}, "parallelism"),
        ({"speculative": True}, "speculative decoding"),
        ({"lora": True}, "LoRA"),
    ],
)
def test_unsupported_combinations_are_refused_by_name(change, named):
    with pytest.raises(ValueError, match="batch_invariant=True does not support") as error:
        check_batch_invariant(**{**SUPPORTED, **change})
    assert named in str(error.value)
