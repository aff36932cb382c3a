"""`SlotIndex`: a step's per-token adapter slots on the device, uploaded only when they change.

The LoRA hooks read one index per step, `[num_tokens]` int64, the token's slot in the
stacks (-1 = the base model). It is built from the batch's runs, one (slot, number of
tokens) per request in batch order, and kept in a persistent device buffer::

    runs    [(0, 5), (-1, 1), (1, 1)]          one per request: its slot, its tokens
    index   [0 0 0 0 0 -1 1]                   the buffer's first num_tokens entries

A step whose runs equal the last upload's (a steady decode batch) uploads nothing: the
buffer still holds them. Otherwise, on a GPU, the index is written on the host into a
pinned buffer and copied with one non-blocking copy, queued on the current stream behind
the step before (`torch.tensor(values, device="cuda")` would copy from pageable memory and
wait). A pinned buffer must not be rewritten while a copy from it may still be in flight:
there are two, used in turn, each with an event recorded behind its last copy that the
host waits for before writing it again (the copy of two steps ago: done by then in
practice). On other devices the index is a plain tensor made from the list, as before.

The allocator and the event are arguments so that a CPU test runs the pinned path
(tests/engine/lora/test_slot_index.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

Run = tuple[int, int]  # (slot, number of tokens)


def _pinned_empty(numel: int) -> torch.Tensor:
    return torch.empty(numel, dtype=torch.int64, pin_memory=True)


class SlotIndex:
    def __init__(
        self,
        device: torch.device,
        pinned: bool | None = None,
        alloc: Callable[[int], torch.Tensor] = _pinned_empty,
        make_event: Callable[[], Any] | None = None,
        capacity: int = 256,
    ) -> None:
        """`pinned`: None decides by the device (CUDA); a CPU test passes True with a
        stand-in `alloc` (an int64 host tensor of that many entries) and `make_event`."""
        self.device = device
        self.pinned = device.type == "cuda" if pinned is None else pinned
        self._alloc = alloc
        self._make_event = make_event or (torch.cuda.Event if self.pinned else None)
        self._runs: list[Run] | None = None  # what the index holds now
        self._index: torch.Tensor | None = None  # [num_tokens] on the device
        self._capacity = 0
        self._host: list[torch.Tensor] = []  # two pinned buffers, used in turn
        self._events: list[Any] = [None, None]  # recorded behind each one's last copy
        self._turn = 0
        self._buffer: torch.Tensor | None = None  # [capacity] on the device
        self._min_capacity = capacity
        self.num_uploads = 0

    def update(self, runs: Sequence[Run]) -> torch.Tensor:
        """The index of `runs` on the device: `[sum of the numbers of tokens]` int64."""
        if self._index is not None and runs == self._runs:
            return self._index  # the same layout: nothing to upload
        runs = list(runs)
        slots = np.fromiter((s for s, _ in runs), dtype=np.int64, count=len(runs))
        counts = np.fromiter((n for _, n in runs), dtype=np.int64, count=len(runs))
        values = np.repeat(slots, counts)  # [num_tokens]
        if self.pinned:
            self._index = self._upload_pinned(values)
        else:
            self._index = torch.tensor(values, device=self.device)
        self._runs = runs
        self.num_uploads += 1
        return self._index

    def _upload_pinned(self, values: np.ndarray) -> torch.Tensor:
        num_tokens = len(values)
        if num_tokens > self._capacity:
            self._grow(num_tokens)
        assert self._buffer is not None
        turn = self._turn
        event = self._events[turn]
        if event is not None:
            event.synchronize()  # its last copy is done: the buffer may be rewritten
        host = self._host[turn]
        host.numpy()[:num_tokens] = values
        index = self._buffer[:num_tokens]
        index.copy_(host[:num_tokens], non_blocking=True)
        event = self._make_event()  # type: ignore[misc]
        event.record()
        self._events[turn] = event
        self._turn = 1 - turn
        return index

    def _grow(self, num_tokens: int) -> None:
        """Buffers for at least `num_tokens`. The old ones are dropped: torch's caching
        allocators keep a block a queued copy or kernel still uses until it is done."""
        capacity = max(self._min_capacity, 1 << (num_tokens - 1).bit_length())
        self._host = [self._alloc(capacity), self._alloc(capacity)]
        self._events = [None, None]
        self._buffer = torch.empty(capacity, dtype=torch.int64, device=self.device)
        self._capacity = capacity
