"""Per-request controls over which tokens may be sampled, each one vectorised op over the
batch (the per-row Python logits processors excepted):

    grammar bitmask   [G, ceil(V / 32)] int32 for the G constrained rows, applied in place,
                      bit j of word w = token 32 w + j allowed
    allowed_token_ids sparse (row, token) pairs: rows listed keep only their tokens
    bad_words         sparse (row, token) pairs set to -inf this step
    logit_bias        sparse (row, token, bias) added

Masked tokens get -inf, never a large negative number, so a masked token has probability
exactly 0 under every temperature and filter.
"""

from __future__ import annotations

import inspect

import torch

from engine.sample.metadata import SamplingMetadata


def apply_grammar_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, row_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Sets the logits the grammar forbids to -inf, in place, in the constrained rows only.

    logits: [B, V]; bitmask: [G, ceil(V / 32)] int32; row_ids: [G] int64, the rows of
    `logits` the bitmask rows belong to (None: G == B, every row). Returns `logits` (a
    contiguous copy first only if `logits` is not contiguous, e.g. an expanded view).

    In place because the copy was the cost: at batch 64 on a 49k vocabulary a copy of the
    logits, and xgrammar's CPU kernel (which is fast on all-allowed words, ~3x slower than
    this on the mostly-forbidden words of a JSON grammar), dominated the masking. The int32
    words are read as bytes (little-endian: byte j of word w holds tokens 32 w + 8 j ..) and
    each byte expanded to its 8 "forbidden" flags by a 256-entry table: one gather, then one
    masked fill, on any device.
    """
    if not logits.is_contiguous():
        logits = logits.contiguous()
    num_rows, vocab_size = bitmask.shape[0], logits.shape[1]
    packed = bitmask.to(logits.device).contiguous().view(torch.uint8).flatten()  # [G * 4 W]
    table = _forbidden_table(logits.device)
    forbidden = table.index_select(0, packed.int()).view(num_rows, -1)[:, :vocab_size]
    if row_ids is None:
        return logits.masked_fill_(forbidden, float("-inf"))  # [B, V], B == G
    constrained = logits.index_select(0, row_ids).masked_fill_(forbidden, float("-inf"))
    return logits.index_copy_(0, row_ids, constrained)  # [B, V]; other rows untouched


_FORBIDDEN_TABLES: dict[torch.device, torch.Tensor] = {}


def _forbidden_table(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: row b = the cleared bits of byte b, least significant first."""
    table = _FORBIDDEN_TABLES.get(device)
    if table is None:
        values = torch.arange(256, device=device).unsqueeze(-1)
        table = ((values >> torch.arange(8, device=device)) & 1) == 0
        _FORBIDDEN_TABLES[device] = table
    return table


def apply_token_controls(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """allowed_token_ids, bad_words, logit_bias, then the Python logits processors (in
    vLLM's order). Returns a new tensor when any applies; `logits` is never modified."""
    if (
        metadata.allowed_row_ids is None
        and metadata.bad_words_row_ids is None
        and metadata.logit_bias_row_ids is None
        and not metadata.logits_processors
    ):
        return logits
    logits = logits.clone()  # [B, V] float32
    if metadata.allowed_row_ids is not None:
        keep = metadata.allowed_row_mask.unsqueeze(-1).logical_not().expand_as(logits).clone()
        keep[metadata.allowed_row_ids, metadata.allowed_token_ids] = True  # [B, V]
        logits.masked_fill_(~keep, float("-inf"))
    if metadata.bad_words_row_ids is not None:
        logits[metadata.bad_words_row_ids, metadata.bad_words_token_ids] = float("-inf")
    if metadata.logit_bias_row_ids is not None:
        logits.index_put_(
            (metadata.logit_bias_row_ids, metadata.logit_bias_token_ids),
            metadata.logit_bias_values,
            accumulate=True,
        )
    for row, processors, prompt_ids, output_ids in metadata.logits_processors:
        for processor in processors:
            logits[row] = _call_processor(processor, prompt_ids, output_ids, logits[row])
    return logits


def _call_processor(processor, prompt_ids: list[int], output_ids: list[int], row: torch.Tensor):
    """vLLM's two signatures: (output_ids, logits) or (prompt_ids, output_ids, logits)."""
    if len(inspect.signature(processor).parameters) == 3:
        return processor(list(prompt_ids), list(output_ids), row)
    return processor(list(output_ids), row)
