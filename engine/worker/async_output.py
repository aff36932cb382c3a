"""The step's one device-to-host copy, started at launch and waited for at finish.

With async scheduling (engine/core/async_scheduling.py) the runner splits a step in two:

    launch(step N)   inputs, forward, sampling; start the copy of the step's reads
    launch(step N+1) ...the device still runs step N; N+1's placeholder ids come from
                     step N's sampled ids on the device (engine/worker/placeholder_inputs.py)
    finish(step N)   wait for N's copy; build its ModelRunnerOutput

On a GPU the copy goes into pinned host memory with `non_blocking=True` and a CUDA event
is recorded behind it: `finish` waits on that event only (not on the whole device, which
by then runs step N+1). On the CPU the copy is plain: it is done when `start` returns.
Both share `HostCopy`'s interface, and the pinned/event logic takes its allocator and
event as arguments so that a CPU test can run it (tests/engine/worker/test_async_output.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from engine.worker import host_reads


class PendingCopy(Protocol):
    def wait(self) -> list[Any]:
        """The copied values as a flat Python list (blocks until they are on the host)."""
        ...


class HostCopy(Protocol):
    def start(self, flat: torch.Tensor) -> PendingCopy:
        """Starts copying a 1-D device tensor to the host."""
        ...


class _Done:
    def __init__(self, values: list[Any]) -> None:
        self._values = values

    def wait(self) -> list[Any]:
        return self._values


class SyncCopy:
    """The CPU's copy: the tensor is already on the host, so the read happens now."""

    def start(self, flat: torch.Tensor) -> PendingCopy:
        return _Done(host_reads.to_host(flat))


class _EventCopy:
    def __init__(self, buffer: torch.Tensor, event: Any) -> None:
        self._buffer = buffer
        self._event = event

    def wait(self) -> list[Any]:
        self._event.synchronize()  # this copy only, not the step queued behind it
        return host_reads.to_host(self._buffer)


def _pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    # torch's caching host allocator: pinned pages are reused, not allocated per step.
    return torch.empty(numel, dtype=dtype, pin_memory=True)


class PinnedEventCopy:
    """A GPU's copy: into a fresh pinned buffer (two steps may be in flight, so one buffer
    each), non-blocking, with an event recorded on the current stream behind it."""

    def __init__(
        self,
        alloc: Callable[[int, torch.dtype], torch.Tensor] = _pinned_empty,
        make_event: Callable[[], Any] | None = None,
    ) -> None:
        self._alloc = alloc
        self._make_event = make_event or torch.cuda.Event

    def start(self, flat: torch.Tensor) -> PendingCopy:
        buffer = self._alloc(flat.numel(), flat.dtype)
        buffer.copy_(flat, non_blocking=True)
        event = self._make_event()
        event.record()
        return _EventCopy(buffer, event)


def make_host_copy(device: torch.device) -> HostCopy:
    """The device's way of reading a step's results."""
    if device.type == "cuda":
        return PinnedEventCopy()
    return SyncCopy()


class PendingOutput:
    """A launched step: its output, filled in by `finish` once the step's reads are on the
    host (each finisher fills in what one part of the step read: sampled ids, logprobs)."""

    def __init__(self, output: Any, finishers: list[Callable[[], None]]) -> None:
        self.output = output  # ModelRunnerOutput
        self._finishers = finishers

    def finish(self) -> Any:
        for finisher in self._finishers:
            finisher()
        self._finishers = []
        return self.output
