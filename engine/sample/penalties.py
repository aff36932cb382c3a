"""Logit adjustments applied before greedy and random sampling: min_tokens and penalties."""

from __future__ import annotations

import torch

from engine.sample.metadata import SamplingMetadata


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Rows short of their min_tokens may not sample a stop or EOS id: those get -inf.

    Returns a new tensor when anything is masked; `logits` itself is never modified.
    """
    if metadata.min_tokens_row_ids is None:
        return logits
    assert metadata.min_tokens_token_ids is not None
    indices = (metadata.min_tokens_row_ids, metadata.min_tokens_token_ids)
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put(indices, neg_inf)


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition, then frequency, then presence penalty (vLLM's order), on [B, V] logits.

    - repetition (HF/vLLM): a token seen in the prompt or the output has its logit divided
      by the penalty when positive, multiplied by it when not;
    - frequency: subtract penalty * (times the token occurs in the output);
    - presence: subtract penalty once if the token occurs in the output.
    Only the listed (row, token) pairs are touched, so rows with penalties off keep their
    logits bit for bit. Returns a new tensor when anything changes.
    """
    use_repetition = metadata.repetition_penalties is not None
    use_output = metadata.presence_penalties is not None or metadata.frequency_penalties is not None
    if not (use_repetition or use_output):
        return logits
    if metadata.penalty_row_ids is not None:
        return _apply_dense_penalties(logits, metadata)
    logits = logits.clone()
    if metadata.repetition_penalties is not None:
        assert metadata.seen_row_ids is not None and metadata.seen_token_ids is not None
        index = (metadata.seen_row_ids, metadata.seen_token_ids)
        values = logits[index]  # [S]
        penalty = metadata.repetition_penalties[metadata.seen_row_ids]  # [S]
        logits[index] = torch.where(values > 0, values / penalty, values * penalty)
    if use_output:
        rows, counts = metadata.output_row_ids, metadata.output_token_counts
        assert rows is not None and counts is not None and metadata.output_token_ids is not None
        index = (rows, metadata.output_token_ids)
        values = logits[index]  # [N]
        if metadata.frequency_penalties is not None:
            values = values - metadata.frequency_penalties[rows] * counts
        if metadata.presence_penalties is not None:
            values = values - metadata.presence_penalties[rows]
        logits[index] = values  # pairs are distinct, so a plain write
    return logits


def _apply_dense_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """`apply_penalties` over the device's dense rows (engine/sample/penalty_state.py): the
    same operations in the same order on the same (row, token) pairs, the other logits kept
    bit for bit (a row whose penalty is off computes x / 1, x * 1 or x - 0 exactly)."""
    rows = metadata.penalty_row_ids  # [P]
    counts = metadata.penalty_counts  # [P, V] int32
    assert rows is not None and counts is not None
    values = logits[rows]  # [P, V]
    if metadata.repetition_penalties is not None:
        assert metadata.penalty_prompt_mask is not None
        seen = metadata.penalty_prompt_mask | (counts > 0)  # [P, V]
        penalty = metadata.repetition_penalties[rows].unsqueeze(-1)  # [P, 1]
        penalised = torch.where(values > 0, values / penalty, values * penalty)
        values = torch.where(seen, penalised, values)
    if metadata.presence_penalties is not None or metadata.frequency_penalties is not None:
        adjusted = values
        if metadata.frequency_penalties is not None:
            frequency = metadata.frequency_penalties[rows].unsqueeze(-1)  # [P, 1]
            adjusted = adjusted - frequency * counts.to(torch.float32)
        if metadata.presence_penalties is not None:
            adjusted = adjusted - metadata.presence_penalties[rows].unsqueeze(-1)
        values = torch.where(counts > 0, adjusted, values)
    logits = logits.clone()
    logits[rows] = values
    return logits
