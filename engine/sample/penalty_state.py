"""What the penalties read, kept on the device across steps: per penalised request, the
counts of its output tokens and the mask of its prompt tokens.

A request with a presence, frequency or repetition penalty gets a row here when it takes its
sampling slot (engine/sample/sampling_slots.py), built once from its token lists; after each
step the tokens it sampled are counted on the device (one scatter-add over the step's
sampled ids), so no step reads the output so far from the host, and async scheduling need
not fall back for penalties.

Representation: dense rows, and only for requests that have a penalty::

    counts      [P, V] int32  times each token occurs in the row's output
    prompt_mask [P, V] bool   tokens of the row's prompt (the repetition penalty's "seen"
                              tokens are prompt_mask | counts > 0)

P grows (doubling) with the number of penalised requests held at once, so an engine whose
requests use no penalty holds nothing; each penalised request costs 5 V bytes (about 240 KiB
at V = 49152, 60 MiB for 256 at once). Dense rows cost one [B_p, V] gather per step, which
a GPU does in microseconds, against a sparse list of (row, token) pairs that would have to
be rebuilt and uploaded from the host each step.

The host knows when a row's counts could be stale: the slot's position (tokens sampled so
far) moved otherwise than by the steps counted here. The row is then built again from the
request's token lists, which must hold every token (none in flight).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Pin = Callable[[torch.Tensor], torch.Tensor]


class PenaltyState:
    def __init__(
        self, device: torch.device, vocab_size: int, pin: Pin | None = None, capacity: int = 1
    ) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.pin = pin
        self._row_of: dict[int, int] = {}  # sampling slot -> row
        self._free: list[int] = []
        self._capacity = 0
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._grow(capacity)

    def row(self, slot: int) -> int | None:
        return self._row_of.get(slot)

    def release(self, slot: int) -> None:
        row = self._row_of.pop(slot, None)
        if row is not None:
            self._free.append(row)

    def fill(self, slot: int, prompt_token_ids: list[int], output_token_ids: list[int]) -> int:
        """The slot's row (a free one if it has none), built from the request's tokens."""
        row = self._row_of.get(slot)
        if row is None:
            if not self._free:
                self._grow(2 * self._capacity)
            row = self._row_of[slot] = self._free.pop()
        num_prompt = len(prompt_token_ids)
        ids = self._upload(prompt_token_ids + output_token_ids)  # [num_prompt + num_output]
        self.prompt_mask[row].zero_()
        self.prompt_mask[row].index_fill_(0, ids[:num_prompt], True)
        self.counts[row].zero_()
        ones = torch.ones_like(ids[num_prompt:], dtype=torch.int32)
        self.counts[row].index_add_(0, ids[num_prompt:], ones)
        return row

    def count(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """One more occurrence of token_ids[i] in row rows[i] (rows distinct), on the device."""
        ones = torch.ones_like(token_ids, dtype=torch.int32)
        self.counts.index_put_((rows, token_ids), ones, accumulate=True)

    def _grow(self, capacity: int) -> None:
        old = self._capacity
        counts = torch.zeros(capacity, self.vocab_size, dtype=torch.int32, device=self.device)
        mask = torch.zeros(capacity, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        mask[:old] = self.prompt_mask
        self.counts, self.prompt_mask = counts, mask
        self._free.extend(range(capacity - 1, old - 1, -1))
        self._capacity = capacity

    def _upload(self, values: list[int]) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=torch.int64)
        if self.pin is None:
            return tensor.to(self.device)
        return self.pin(tensor).to(self.device, non_blocking=True)
