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
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    token_rope_lengths: list[int] = []
    num_decodes = 0
    for i, (token_ids, num_computed, block_table) in enumerate(requests):
        num_new = len(token_ids)
        if num_new == 1 and num_decodes == len(seq_lens):
            num_decodes += 1
        input_ids.extend(token_ids)
        for pos in range(num_computed, num_computed + num_new):
            positions.append(pos)
            slots.append(block_table[pos // block_size] * block_size + pos % block_size)
        if rope_lengths is not None:
            token_rope_lengths.extend([rope_lengths[i]] * num_new)
        query_start_loc.append(query_start_loc[-1] + num_new)
        seq_lens.append(num_computed + num_new)
    max_blocks = max(len(table) for _, _, table in requests)
    tables = [table + [0] * (max_blocks - len(table)) for _, _, table in requests]
    query_lens = [b - a for a, b in itertools.pairwise(query_start_loc)]
    metadata = AttentionMetadata(
        num_actual_tokens=len(input_ids),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        rope_lengths=(
            None
            if rope_lengths is None
            else torch.tensor(token_rope_lengths, dtype=torch.int64, device=device)
        ),
    )
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        attn_metadata=metadata,
        query_start_loc_cpu=query_start_loc,
    )
