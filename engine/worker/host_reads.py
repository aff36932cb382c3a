"""The step's device-to-host read: what the host needs from a step, in one copy.

On a GPU every read of a device tensor (`.tolist()`, `.item()`, `.cpu()`) waits for the
whole step to finish: with several reads per step the host waits several times, and
cannot prepare the next step meanwhile (issue 42). The runner therefore gathers what it
needs (sampled ids, greedy-screen ids, logprobs) into one `StepReads` and reads them with
one transfer::

    reads = StepReads()
    ids = reads.add(sampled_token_ids)        # [B] int64
    top = reads.add(logprobs)                 # [B, k + 1] float32
    host = reads.read()                       # one copy: host[ids], host[top] are lists

Integer parts alone are copied as int64; with a float part everything goes as float64,
which holds every float32 value and every integer below 2**53 (token ids, ranks) exactly,
so the lists are the ones `.tolist()` of each part gives.

`to_host` is the one place the runner reads a device tensor; tests count its calls
(tests/engine/worker/test_step_transfers.py).
"""

from __future__ import annotations

from typing import Any

import torch


def to_host(tensor: torch.Tensor) -> list[Any]:
    """The tensor's values as (nested) Python lists: one device-to-host copy."""
    return tensor.tolist()


class StepReads:
    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []

    def add(self, tensor: torch.Tensor) -> int:
        """Queues a 1-D or 2-D tensor; returns its index in `read()`'s result."""
        assert tensor.dim() in (1, 2), tensor.shape
        self._parts.append(tensor)
        return len(self._parts) - 1

    def read(self) -> list[list[Any]]:
        """Every queued tensor as lists (2-D ones as lists of rows), with one copy."""
        return self.start().wait()

    def start(self, copy: Any = None) -> PendingReads:
        """Starts the one copy (`copy`: an `async_output.HostCopy`; None reads now);
        `wait()` on the result gives what `read()` does."""
        parts = self._parts
        if not parts:
            return PendingReads([], None)
        floating = any(p.dtype.is_floating_point for p in parts)
        dtype = torch.float64 if floating else torch.int64
        flat = torch.cat([p.reshape(-1).to(dtype) for p in parts]) if len(parts) > 1 else (
            parts[0].reshape(-1).to(dtype)
        )  # fmt: skip
        if copy is None:
            values: list[Any] = to_host(flat)
            return PendingReads(parts, lambda: values)
        pending = copy.start(flat)
        return PendingReads(parts, pending.wait)


class PendingReads:
    """A started `StepReads` copy; `wait()` splits the values into the parts' lists."""

    def __init__(self, parts: list[torch.Tensor], values: Any) -> None:
        self._parts = parts
        self._values = values  # () -> flat list, or None when nothing was queued

    def wait(self) -> list[list[Any]]:
        parts = self._parts
        if not parts:
            return []
        floating = any(p.dtype.is_floating_point for p in parts)
        values = self._values()
        result: list[list[Any]] = []
        offset = 0
        for part in parts:
            chunk = values[offset : offset + part.numel()]
            offset += part.numel()
            if floating and not part.dtype.is_floating_point:
                chunk = [int(v) for v in chunk]
            if part.dim() == 2:
                width = part.shape[1]
                chunk = [chunk[r * width : (r + 1) * width] for r in range(part.shape[0])]
            result.append(chunk)
        return result
