"""Flat per-step input tensors for the model and the attention backend."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
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

    The per-token arrays are computed with numpy over the whole batch (a request's row
    repeated over its tokens), so a decode step costs a few list comprehensions and array
    operations rather than a Python loop per token (issue 42: the host's time per step).
    """
    num_reqs = len(requests)
    token_id_lists, computed, block_tables = zip(*requests)  # three tuples, in C
    input_ids = list(itertools.chain.from_iterable(token_id_lists))
    query_lens = np.fromiter(map(len, token_id_lists), np.int64, num_reqs)
    num_computed = np.array(computed, np.int64)
    num_decodes = 0  # requests with one new token, before the first with more
    if num_reqs and query_lens[0] == 1:
        longer = np.flatnonzero(query_lens != 1)
        num_decodes = int(longer[0]) if len(longer) else num_reqs
    query_start_loc = np.zeros(num_reqs + 1, np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    seq_lens = num_computed + query_lens
    num_tokens = int(query_start_loc[-1])
    tables = _padded_block_tables(block_tables)  # [num_reqs, max_blocks]
    if num_tokens == num_reqs:  # one token each (a decode step)
        positions = num_computed
        rows = np.arange(num_reqs)
    else:
        rows = np.repeat(np.arange(num_reqs), query_lens)  # each token's request
        positions = np.arange(num_tokens) - query_start_loc[rows] + num_computed[rows]
    slots = tables[rows, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    query_start_loc_cpu = query_start_loc.tolist()
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=_to(query_start_loc.astype(np.int32), device),
        seq_lens=_to(seq_lens.astype(np.int32), device),
        block_tables=_to(tables, device),
        slot_mapping=_to(slots, device),
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens_cpu=seq_lens.tolist(),
        rope_lengths=(
            None
            if rope_lengths is None
            else _to(np.repeat(np.asarray(rope_lengths, np.int64), query_lens), device)
        ),
    )
    return StepInputs(
        input_ids=_to(np.asarray(input_ids, np.int64), device),
        positions=_to(np.ascontiguousarray(positions), device),
        attn_metadata=metadata,
        query_start_loc_cpu=query_start_loc_cpu,
    )


def _padded_block_tables(tables: tuple[list[int], ...]) -> np.ndarray:
    """[num_reqs, max_blocks] int32, each table padded with block 0 (never read: the
    attention masks past a request's length)."""
    max_blocks = max(map(len, tables))
    flat: list[int] = []
    for table in tables:
        flat += table
        if len(table) < max_blocks:
            flat += [0] * (max_blocks - len(table))
    return np.asarray(flat, np.int32).reshape(len(tables), max_blocks)


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """The array as a tensor on `device` (on the CPU, sharing its memory: no copy)."""
    return torch.from_numpy(array).to(device)
