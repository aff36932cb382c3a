"""Several ranks on CUDA: each rank takes one GPU, so the engine refuses a device index and
more ranks than visible GPUs at start-up, with the numbers. Only a CUDA engine takes these
checks; they read nothing but the device string and `torch.cuda.device_count()`, so they run
here whatever the machine has."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from engine.distributed.sharding import verify_parallel_config

HF_CONFIG = LlamaConfig(
    hidden_size=1024, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=64,
    num_key_value_heads=16, vocab_size=128,
)  # fmt: skip


def _verify(device: str, tp: int) -> None:
    parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1)
    args = SimpleNamespace(device=device, enable_lora=False, enable_sleep_mode=False)
    verify_parallel_config(HF_CONFIG, parallel, args)


def test_ranks_refuse_a_device_index() -> None:
    with pytest.raises(ValueError, match=r"device='cuda:1'.*pass device='cuda'"):
        _verify("cuda:1", 2)


def test_ranks_need_one_visible_gpu_each() -> None:
    visible = torch.cuda.device_count()
    tp = 2
    while tp <= visible:  # more ranks than GPUs, a power of two the heads divide into
        tp *= 2
    with pytest.raises(ValueError, match=f"{tp} ranks need {tp} GPUs, {visible} visible"):
        _verify("cuda", tp)
    _verify("cpu", tp)  # CPU ranks: no GPU to count
