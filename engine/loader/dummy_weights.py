"""Random weights in place of a checkpoint: vLLM's `load_format="dummy"`.

Benchmarks need a model of a real model's shapes and dtype (Llama-3.1-8B: 16 GB in bf16)
on a machine that cannot reach the model hub, and writing then reading 16 GB of random
safetensors would cost minutes of device time. With `load_format="dummy"` the model
directory needs only its config.json; every parameter is drawn on the device, uniform in
[-1e-3, 1e-3] as vLLM draws them (small enough that activations stay finite in bf16), from
a generator seeded by `seed`, so two engines with the same seed hold the same weights.
The tokens such a model produces mean nothing; its speed is the real model's.
"""

from __future__ import annotations

import torch
from torch import nn

DUMMY_RANGE = 1e-3


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """Draws every parameter of `model` (allocated, uninitialised) in place."""
    generators: dict[torch.device, torch.Generator] = {}
    for _, param in model.named_parameters():
        if param.numel() == 0:
            continue
        device = param.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        if param.is_floating_point():
            param.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=generators[device])
        else:  # no integer parameter exists today; zeros are a safe draw for one
            param.zero_()
