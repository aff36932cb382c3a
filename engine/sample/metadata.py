"""The per-step inputs of the sampler: one `SamplingRow` per request, batched into tensors.

`SamplingMetadata.build` makes every tensor from one `SamplingRow` per request (in batch
order). The model runner instead gathers the per-request values from the slots of
engine/sample/sampling_slots.py and calls `add_row_features` only for what is built from the
rows' tokens and lists each step. The loops here run per request per step; the sampler itself
never loops over rows.

Optional features cost nothing when no row uses them: their tensors are None and the
sampler skips them. When one row uses a feature, every row gets a value that leaves its
logits untouched (top_k 0, top_p 1, min_p 0, penalties 0/0/1), so a row samples the same
token whatever else shares its batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.api.sampling_params import SamplingParams, SamplingType

_INT64_MIN = -(1 << 63)
_UINT64_MASK = (1 << 64) - 1


@dataclass(slots=True)
class SamplingRow:
    """One row of the batch: the request's parameters and tokens so far."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated so far, not yet the one being sampled
    seed: int  # the request's fixed seed (Request.seed)
    grammar: Any = None  # the request's GrammarMatcher under structured outputs
    # Tokens sampled by steps still in flight (async scheduling), not yet in
    # output_token_ids: they count for the seeded sampler's position.
    num_output_placeholders: int = 0


@dataclass(slots=True)
class SamplingMetadata:
    """Batch tensors of one sampling step; B rows, vocabulary of V tokens."""

    vocab_size: int
    temperature: torch.Tensor  # [B] float32, 0 for greedy rows
    all_greedy: bool
    all_random: bool
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64, index in the output of the token being sampled
    # Filters for random rows; None when no row uses them.
    top_k: torch.Tensor | None  # [B] int64, 0 = off
    max_top_k: int  # largest enabled top_k, 0 when top_k is None
    top_p: torch.Tensor | None  # [B] float32, 1 = off
    min_p: torch.Tensor | None  # [B] float32, 0 = off
    # Penalties (greedy rows too); each None when no row uses it. The tokens they act on
    # are listed sparsely, one entry per distinct (row, token), and only for rows whose
    # penalty is on: a row holds a few thousand distinct tokens, the vocabulary ~50k.
    presence_penalties: torch.Tensor | None  # [B] float32, 0 = off
    frequency_penalties: torch.Tensor | None  # [B] float32, 0 = off
    repetition_penalties: torch.Tensor | None  # [B] float32, 1 = off
    max_num_logprobs: int | None  # largest `logprobs` of any row; None: no row asks
    # What follows is built per step from the rows' tokens and lists (`add_row_features`),
    # None until then and wherever no row uses it.
    # Distinct output tokens of rows with a presence or frequency penalty, with counts.
    output_row_ids: torch.Tensor | None = None  # [N] int64
    output_token_ids: torch.Tensor | None = None  # [N] int64
    output_token_counts: torch.Tensor | None = None  # [N] float32, occurrences in the output
    # Distinct prompt-or-output tokens of rows with a repetition penalty.
    seen_row_ids: torch.Tensor | None = None  # [S] int64
    seen_token_ids: torch.Tensor | None = None  # [S] int64
    # min_tokens: logits[min_tokens_row_ids[i], min_tokens_token_ids[i]] = -inf.
    min_tokens_row_ids: torch.Tensor | None = None  # [M] int64
    min_tokens_token_ids: torch.Tensor | None = None  # [M] int64
    # Structured outputs, only for the G rows with a grammar (rows without one pay nothing):
    # bit j of word w of bitmask row g = token 32 w + j allowed in batch row grammar_row_ids[g].
    grammar_bitmask: torch.Tensor | None = None  # [G, ceil(V / 32)] int32; None: no grammar
    grammar_row_ids: torch.Tensor | None = None  # [G] int64; None: every row has a grammar
    # allowed_token_ids: rows with a restriction, and the (row, token) pairs they keep.
    allowed_row_mask: torch.Tensor | None = None  # [B] bool
    allowed_row_ids: torch.Tensor | None = None  # [A] int64
    allowed_token_ids: torch.Tensor | None = None  # [A] int64
    # bad_words: (row, token) pairs that would complete a bad word this step.
    bad_words_row_ids: torch.Tensor | None = None  # [K] int64
    bad_words_token_ids: torch.Tensor | None = None  # [K] int64
    # logit_bias: logits[row, token] += value.
    logit_bias_row_ids: torch.Tensor | None = None  # [L] int64
    logit_bias_token_ids: torch.Tensor | None = None  # [L] int64
    logit_bias_values: torch.Tensor | None = None  # [L] float32
    # The penalties' tokens as dense rows kept on the device across steps, instead of the
    # sparse lists above (engine/sample/penalty_state.py): the batch rows with a penalty.
    penalty_row_ids: torch.Tensor | None = None  # [P] int64
    penalty_counts: torch.Tensor | None = None  # [P, V] int32, occurrences in the output
    penalty_prompt_mask: torch.Tensor | None = None  # [P, V] bool, tokens of the prompt
    # (row, processors, prompt ids, output ids) for rows with Python logits processors.
    logits_processors: list[tuple[int, list[Any], list[int], list[int]]] = field(
        default_factory=list
    )

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @staticmethod
    def build(
        rows: list[SamplingRow], vocab_size: int, device: torch.device | str
    ) -> SamplingMetadata:
        """Every tensor from the rows' Python values. The model runner takes the per-slot
        tensors of engine/sample/sampling_slots.py instead, and calls `add_row_features`
        only for the rows' per-step features."""
        params = [row.params for row in rows]
        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        random = [not g for g in greedy]

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        # Filters only matter for random rows; greedy rows get the "off" value.
        top_k = [p.top_k if r and 0 < p.top_k < vocab_size else 0 for p, r in zip(params, random)]
        top_p = [p.top_p if r else 1.0 for p, r in zip(params, random)]
        min_p = [p.min_p if r else 0.0 for p, r in zip(params, random)]
        presence = [p.presence_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        repetition = [p.repetition_penalty for p in params]
        metadata = SamplingMetadata(
            vocab_size=vocab_size,
            temperature=floats([0.0 if g else p.temperature for p, g in zip(params, greedy)]),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            seeds=ints([to_int64(row.seed) for row in rows]),
            positions=ints([len(r.output_token_ids) + r.num_output_placeholders for r in rows]),
            top_k=ints(top_k) if any(top_k) else None,
            max_top_k=max(top_k, default=0),
            top_p=floats(top_p) if any(v < 1.0 for v in top_p) else None,
            min_p=floats(min_p) if any(v > 0.0 for v in min_p) else None,
            presence_penalties=floats(presence) if any(v != 0.0 for v in presence) else None,
            frequency_penalties=floats(frequency) if any(v != 0.0 for v in frequency) else None,
            repetition_penalties=floats(repetition) if any(v != 1.0 for v in repetition) else None,
            max_num_logprobs=max_num_logprobs(params),
        )
        add_row_features(metadata, rows, device)
        return metadata


def max_num_logprobs(params: list[SamplingParams]) -> int | None:
    """The largest `logprobs` any row asks for; None when none asks."""
    logprobs = [p.logprobs for p in params if p.logprobs is not None]
    return max(logprobs) if logprobs else None


def has_penalty(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


def needs_row_features(params: SamplingParams) -> bool:
    """Whether a request with these parameters may need `add_row_features` in some step
    besides its penalties (which persistent slots count on the device): what reads its
    tokens so far (bad words, logits processors, min_tokens) or is listed per (row, token)
    (allowed ids, logit bias). A grammar is the request's, not its parameters': callers
    check it too."""
    return bool(
        params.min_tokens
        or params.allowed_token_ids is not None
        or params.bad_words_token_ids
        or params.logit_bias
        or params.logits_processors
    )


def add_row_features(
    metadata: SamplingMetadata, rows: list[SamplingRow], device: torch.device | str
) -> None:
    """Fills what is built from the rows' tokens and lists each step: the penalties' tokens
    (their per-row values must be in `metadata` already; not when `penalty_row_ids` says the
    device's counts serve), the min_tokens bans, the grammar
    bitmask and the token controls; only for the features some row uses."""
    vocab_size = metadata.vocab_size

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    params = [row.params for row in rows]
    sparse = metadata.penalty_row_ids is None  # else the device's counts serve
    if sparse and (
        metadata.presence_penalties is not None or metadata.frequency_penalties is not None
    ):
        chosen = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        token_lists = [rows[i].output_token_ids for i in chosen]
        output_rows, output_ids, counts = _distinct_tokens(chosen, token_lists, vocab_size, device)
        metadata.output_row_ids, metadata.output_token_ids = output_rows, output_ids
        metadata.output_token_counts = counts.to(torch.float32)
    if sparse and metadata.repetition_penalties is not None:
        chosen = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        token_lists = [rows[i].prompt_token_ids + rows[i].output_token_ids for i in chosen]
        metadata.seen_row_ids, metadata.seen_token_ids, _ = _distinct_tokens(
            chosen, token_lists, vocab_size, device
        )
    grammar_rows, bitmask = _grammar_bitmask(rows, vocab_size)
    min_tokens_rows, min_tokens_ids = _min_tokens_indices(
        rows, vocab_size, _grammar_complete_rows(rows, grammar_rows, bitmask, vocab_size)
    )
    if min_tokens_rows:
        metadata.min_tokens_row_ids = ints(min_tokens_rows)
        metadata.min_tokens_token_ids = ints(min_tokens_ids)
    if bitmask is not None:
        metadata.grammar_bitmask = bitmask.to(device)
        if len(grammar_rows) < len(rows):
            metadata.grammar_row_ids = ints(grammar_rows)
    _add_token_controls(metadata, rows, vocab_size, device)


def to_int64(value: int) -> int:
    """Any Python int, wrapped to a signed 64-bit value (its low 64 bits)."""
    value &= _UINT64_MASK
    return value + 2 * _INT64_MIN if value >= 1 << 63 else value


def _distinct_tokens(
    row_ids: list[int], token_lists: list[list[int]], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each distinct (row, token) pair of the given rows, as [N] row ids, [N] token ids and
    [N] occurrence counts (int64), sorted by row then token."""
    lengths = torch.tensor([len(ids) for ids in token_lists], dtype=torch.int64)
    rows = torch.tensor(row_ids, dtype=torch.int64).repeat_interleave(lengths)  # [total]
    flat = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
    keys, counts = torch.unique(rows * vocab_size + flat, return_counts=True)  # sorted
    keys, counts = keys.to(device), counts.to(device)
    return keys // vocab_size, keys % vocab_size, counts


def _grammar_bitmask(
    rows: list[SamplingRow], vocab_size: int
) -> tuple[list[int], torch.Tensor | None]:
    """The batch indices of the rows with a grammar and their masks, [G, ceil(V / 32)] int32
    (None when no row has one): one row per constrained request, so the sampler's masking
    costs in proportion to the constrained rows, not the batch."""
    grammar_rows = [i for i, row in enumerate(rows) if row.grammar is not None]
    if not grammar_rows:
        return grammar_rows, None
    bitmask = torch.full((len(grammar_rows), -(-vocab_size // 32)), -1, dtype=torch.int32)
    for g, i in enumerate(grammar_rows):
        rows[i].grammar.fill_bitmask(bitmask, g)
    return grammar_rows, bitmask


def _grammar_complete_rows(
    rows: list[SamplingRow], grammar_rows: list[int], bitmask: torch.Tensor | None, vocab_size: int
) -> set[int]:
    """Rows still short of min_tokens whose grammar allows nothing but a stop token: the
    value is complete. There the grammar wins over min_tokens (as vLLM does): banning the
    stops would leave no token at all, so the request ends with "stop" instead."""
    complete: set[int] = set()
    for g, i in enumerate(grammar_rows):
        params = rows[i].params
        if len(rows[i].output_token_ids) >= params.min_tokens:
            continue
        assert bitmask is not None
        words = bitmask[g].clone()  # [ceil(V / 32)] int32
        for token in params.all_stop_token_ids:
            if token < vocab_size:
                words[token // 32] &= ~(1 << (token % 32)) if token % 32 < 31 else 0x7FFFFFFF
        words[-1] &= _valid_bits(vocab_size)
        if not bool(words.any()):
            complete.add(i)
    return complete


def _valid_bits(vocab_size: int) -> int:
    """The int32 mask of the last bitmask word's bits that are real tokens."""
    used = vocab_size % 32
    return -1 if used == 0 else (1 << used) - 1


def _min_tokens_indices(
    rows: list[SamplingRow], vocab_size: int, grammar_complete: set[int]
) -> tuple[list[int], list[int]]:
    """(row, token) pairs to mask: rows short of min_tokens may not sample a token that would
    stop them (as in vLLM: EOS only when it stops the request, i.e. without ignore_eos),
    unless their grammar is complete."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        params = row.params
        if len(row.output_token_ids) >= params.min_tokens or i in grammar_complete:
            continue
        banned = sorted(t for t in params.all_stop_token_ids if t < vocab_size)
        row_ids.extend([i] * len(banned))
        token_ids.extend(banned)
    return row_ids, token_ids


def _add_token_controls(
    metadata: SamplingMetadata, rows: list[SamplingRow], vocab_size: int, device: Any
) -> None:
    """Fills the sparse allowed/bad-words/bias indices, only for the features some row
    uses."""

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    allowed = [(i, t) for i, r in enumerate(rows) for t in r.params.allowed_token_ids or []]
    if allowed:
        restricted = [r.params.allowed_token_ids is not None for r in rows]
        metadata.allowed_row_mask = torch.tensor(restricted, dtype=torch.bool, device=device)
        metadata.allowed_row_ids = ints([i for i, _ in allowed])
        metadata.allowed_token_ids = ints([t for _, t in allowed])
    banned = [(i, t) for i, r in enumerate(rows) for t in _bad_word_bans(r)]
    if banned:
        metadata.bad_words_row_ids = ints([i for i, _ in banned])
        metadata.bad_words_token_ids = ints([t for _, t in banned])
    bias = [(i, t, b) for i, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items()]
    if bias:
        metadata.logit_bias_row_ids = ints([i for i, _, _ in bias])
        metadata.logit_bias_token_ids = ints([t for _, t, _ in bias])
        metadata.logit_bias_values = torch.tensor(
            [b for _, _, b in bias], dtype=torch.float32, device=device
        )
    metadata.logits_processors = [
        (i, r.params.logits_processors, r.prompt_token_ids, r.output_token_ids)
        for i, r in enumerate(rows)
        if r.params.logits_processors
    ]


def _bad_word_bans(row: SamplingRow) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far (as vLLM:
    a one-token bad word is always banned)."""
    banned = []
    output = row.output_token_ids
    for word in row.params.bad_words_token_ids or []:
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
            banned.append(word[-1])
    return banned
