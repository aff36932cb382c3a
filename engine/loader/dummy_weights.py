"""Random weights in place of a checkpoint: vLLM's `load_format="dummy"`.

Benchmarks need a model of a real model's shapes and dtype (Llama-3.1-8B: 16 GB in bf16)
on a machine that cannot reach the model hub, and writing then reading 16 GB of random
safetensors would cost minutes of device time. With `load_format="dummy"` the model
directory needs only its config.json; every parameter is drawn on the device, uniform in
[-1e-3, 1e-3] as vLLM draws them (small enough that activations stay finite in bf16), from
a generator seeded by `seed`, so two engines with the same seed hold the same weights.
The tokens such a model produces mean nothing; its speed is the real model's.

An FP8 model (a config.json with an FP8 `quantization_config`, its projections kept in FP8:
engine/loader/fp8_weights.py) draws its FP8 weights over E4M3's range and gives each row
the scale DUMMY_RANGE / 448, so the weights it stands for are in the same range.
"""

from __future__ import annotations

import torch
from torch import nn

DUMMY_RANGE = 1e-3
_FP8_MAX = 448.0


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """Draws every parameter of `model` (allocated, uninitialised) in place."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.numel() == 0:
            continue
        device = param.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        if param.dtype == torch.float8_e4m3fn:  # uniform_ has no FP8 kernel: draw, then cast
            values = torch.empty(param.shape, device=device, dtype=torch.bfloat16)
            values.uniform_(-_FP8_MAX, _FP8_MAX, generator=generators[device])
            param.copy_(values)
        elif name.endswith(".weight_scale"):  # the per-row scales of an FP8 weight
            param.fill_(DUMMY_RANGE / _FP8_MAX)
        elif param.is_floating_point():
            param.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=generators[device])
        else:  # no integer parameter exists today; zeros are a safe draw for one
            param.zero_()
