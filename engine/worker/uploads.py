"""Host-to-device uploads that do not wait for the device (async scheduling on a GPU).

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronises the
stream: with step N still running, launching step N+1 would wait for it at the first
upload (engine/core/async_scheduling.py). Here the values go into pinned memory and are
copied with `non_blocking=True` on the current stream, so the copy is queued behind step N
like a kernel (torch's caching host allocator keeps the pinned block until the copy is
done). On the CPU, and with async scheduling off, uploads are as before.

`pin` is an argument so that a CPU test runs the pinned path with a stand-in
(tests/engine/worker/test_async_output.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from engine.worker.inputs import StepInputs, build_step_inputs

Pin = Callable[[torch.Tensor], torch.Tensor]


def _pin(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory()


def upload(
    values: list[Any], dtype: torch.dtype, device: torch.device, pin: Pin | None = None
) -> torch.Tensor:
    """`values` as a tensor on `device`; with `pin`, through pinned memory, non-blocking."""
    if pin is None:
        return torch.tensor(values, dtype=dtype, device=device)
    return pin(torch.tensor(values, dtype=dtype)).to(device, non_blocking=True)


def upload_step_inputs(inputs: StepInputs, device: torch.device, pin: Pin) -> StepInputs:
    """Step inputs built on the CPU, their tensors moved to `device` without waiting."""

    def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else pin(tensor).to(device, non_blocking=True)

    metadata = inputs.attn_metadata
    moved = {
        f.name: move(getattr(metadata, f.name))
        for f in dataclasses.fields(metadata)
        if isinstance(getattr(metadata, f.name), torch.Tensor)
    }
    return dataclasses.replace(
        inputs,
        input_ids=move(inputs.input_ids),
        positions=move(inputs.positions),
        attn_metadata=dataclasses.replace(metadata, **moved),
    )


class Uploader:
    """The runner's uploads: `pinned` (async scheduling on a GPU) or plain."""

    def __init__(self, device: torch.device, pinned: bool, pin: Pin = _pin) -> None:
        self.device = device
        self.pin = pin if pinned else None

    def __call__(self, values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        return upload(values, dtype, self.device, self.pin)

    def step_inputs(
        self,
        requests: list[tuple[list[int], int, list[int]]],
        block_size: int,
        rope_lengths: list[int] | None,
    ) -> StepInputs:
        if self.pin is None:
            return build_step_inputs(requests, block_size, self.device, rope_lengths)
        inputs = build_step_inputs(requests, block_size, torch.device("cpu"), rope_lengths)
        return upload_step_inputs(inputs, self.device, self.pin)


def make_uploader(device: torch.device, async_scheduling: bool) -> Uploader:
    return Uploader(device, pinned=async_scheduling and device.type == "cuda")
