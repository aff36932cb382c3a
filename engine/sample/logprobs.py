"""Logprobs of chosen tokens plus the top-k alternatives, for sampled and prompt tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LogprobsTensors:
    """Logprobs for N positions (batch rows, or prompt positions).

    Column 0 is the chosen token (the sampled one, or the next prompt token); columns
    1..k are the k most likely tokens, most likely first. A row may use fewer than k of
    them: the caller slices each row to its request's own `logprobs` count.
    """

    token_ids: torch.Tensor  # [N, k + 1] int64
    logprobs: torch.Tensor  # [N, k + 1] float32
    ranks: torch.Tensor  # [N] int64, rank of the chosen token: 1 = most likely

    def slice_rows(self, start: int, end: int) -> LogprobsTensors:
        return LogprobsTensors(
            self.token_ids[start:end], self.logprobs[start:end], self.ranks[start:end]
        )


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] logits (any float dtype) -> [N, V] float32 log-probabilities."""
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Picks the logprob and rank of `token_ids` ([N]) and the top-k of each row of
    `logprobs` ([N, V]). k is capped at V; k = 0 returns the chosen token only.

    The rank counts the tokens strictly more likely than the chosen one, plus one, so the
    argmax has rank 1 even when it ties with another token.
    """
    assert logprobs.dim() == 2 and token_ids.shape == logprobs.shape[:1]
    assert k >= 0
    token_ids = token_ids.to(torch.int64).unsqueeze(-1)  # [N, 1]
    token_logprobs = logprobs.gather(-1, token_ids)  # [N, 1]
    ranks = (logprobs > token_logprobs).sum(-1) + 1  # [N]
    k = min(k, logprobs.shape[-1])
    if k == 0:
        return LogprobsTensors(token_ids, token_logprobs, ranks)
    topk_logprobs, topk_ids = logprobs.topk(k, dim=-1)  # [N, k] each, most likely first
    return LogprobsTensors(
        token_ids=torch.cat([token_ids, topk_ids], dim=-1),
        logprobs=torch.cat([token_logprobs, topk_logprobs], dim=-1),
        ranks=ranks,
    )
