"""Structured outputs over rank processes: the grammars stay on the driver.

A request's grammar matcher lives in the engine process (it advances as tokens are
appended). When the driver builds a step for its ranks it fills, for each constrained
entry that samples, the rows of allowed tokens the runner would ask the matcher for: one
row for a plain decode; for a speculative entry the rows at its k + 1 verification
positions, walking the drafts as `ModelRunner._mask_drafts` does (rows after the first
refused draft stay all-ones, as there). On the rank, `ReplayGrammar` stands in for the
request's grammar state and hands those rows back in the same order, so the runner's code
is the same in one process and in many.
"""

from __future__ import annotations

from typing import Any

import torch


def grammar_rows(entry: Any, vocab_size: int) -> torch.Tensor | None:
    """The entry's allowed-token rows [num_positions, ceil(V / 32)] int32, or None when the
    request has no grammar or samples nothing this step."""
    state = entry.request.structured_output
    matcher = None if state is None else state.matcher
    if matcher is None or not entry.reaches_last_token or entry.request.is_pooling:
        return None
    drafts = entry.spec_token_ids
    rows = torch.full((len(drafts) + 1, -(-vocab_size // 32)), -1, dtype=torch.int32)
    num_walked = 0
    for i in range(len(drafts) + 1):
        matcher.fill_bitmask(rows, i)
        if i == len(drafts) or not matcher.accept_token(drafts[i]):
            break
        num_walked += 1
    matcher.rollback(num_walked)
    return rows


class ReplayGrammar:
    """A rank's stand-in for a request's grammar state (`request.structured_output`): its
    `matcher` replays the driver's rows."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.matcher = _ReplayMatcher(rows)


class _ReplayMatcher:
    def __init__(self, rows: torch.Tensor) -> None:
        self._rows = rows  # [num_positions, ceil(V / 32)] int32
        self._position = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self._rows[self._position])

    def accept_token(self, token_id: int) -> bool:
        word = int(self._rows[self._position, token_id // 32])
        if not (word >> (token_id % 32)) & 1:
            return False
        self._position += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        self._position -= num_tokens
