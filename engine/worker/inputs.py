"""Flat per-step input tensors for the model and the attention backend."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    query_start_loc_cpu: list[int]


def build_step_inputs(
    requests: list[tuple[list[int], int, list[int]]],
    block_size: int,
    device: torch.device,
    rope_lengths: list[int] | None = None,
) -> StepInputs:
    """`requests`: (new token ids, num_computed_tokens, block table) per request, decode
    requests (one new token) first. `rope_lengths` (each request's `Request.rope_length`),
    for a model whose rope scales by the sequence's length, go to the metadata per token
    (engine/config/rope.py, RopeRegime).

    Token at position p of a request goes to slot ``block_table[p // block_size] *
    block_size + p % block_size`` of the flattened cache::

        block_table = [7, 2]      block_size = 4      positions 0..5
        slots       = [28, 29, 30, 31, 8, 9]
    """
    # Python builds only flat lists (one pass, C-level chains); the per-token arithmetic
    # (positions, slots, padded tables) is tensor math on the host, then one upload each.
    num_new = [len(token_ids) for token_ids, _, _ in requests]
    num_computed = [num for _, num, _ in requests]
    num_requests = len(requests)
    input_ids = list(itertools.chain.from_iterable(t for t, _, _ in requests))
    num_tokens = len(input_ids)
    query_start_loc = [0, *itertools.accumulate(num_new)]
    seq_lens = [c + n for c, n in zip(num_computed, num_new)]
    num_decodes = next((i for i, n in enumerate(num_new) if n != 1), num_requests)
    table_lens = [len(table) for _, _, table in requests]
    max_blocks = max(table_lens)
    tables = torch.zeros(num_requests, max_blocks, dtype=torch.int32)  # [B, max_blocks]
    flat_tables = list(itertools.chain.from_iterable(table for _, _, table in requests))
    if len(flat_tables) == num_requests * max_blocks:
        tables.view(-1).copy_(torch.tensor(flat_tables, dtype=torch.int32))
    else:  # row-major fill of each row's first len(table) columns
        filled = torch.arange(max_blocks) < torch.tensor(table_lens).unsqueeze(1)
        tables[filled] = torch.tensor(flat_tables, dtype=torch.int32)
    computed = torch.tensor(num_computed, dtype=torch.int64)  # [B]
    if num_decodes == num_requests:  # one token each: the token's position is the count
        rows = torch.arange(num_requests)
        positions = computed
    else:
        counts = torch.tensor(num_new, dtype=torch.int64)
        rows = torch.arange(num_requests).repeat_interleave(counts, output_size=num_tokens)
        starts = torch.tensor(query_start_loc[:-1], dtype=torch.int64)
        offsets = torch.arange(num_tokens) - starts.repeat_interleave(counts, output_size=num_tokens)
        positions = computed.repeat_interleave(counts, output_size=num_tokens) + offsets
    blocks = tables[rows, positions // block_size].to(torch.int64)  # [num_tokens]
    slots = blocks * block_size + positions % block_size
    token_rope_lengths = None
    if rope_lengths is not None:
        token_rope_lengths = torch.tensor(rope_lengths, dtype=torch.int64).repeat_interleave(
            torch.tensor(num_new, dtype=torch.int64), output_size=num_tokens
        )
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=max(num_new),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=slots.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        rope_lengths=None if token_rope_lengths is None else token_rope_lengths.to(device),
    )
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=positions.to(device),
        attn_metadata=metadata,
        query_start_loc_cpu=query_start_loc,
    )
