"""Flat per-step input tensors for the model and the attention backend."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

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

    A batch of more than `_NUMPY_MIN_REQUESTS` requests computes the per-token columns with
    numpy over the whole batch (a request's row repeated over its tokens) rather than a
    Python loop per token (issue 42: the host's time per step, 0.5 -> 0.2 ms at batch 256
    on the CPU); a smaller one loops, where numpy's fixed costs would be most of the work.
    """
    build = _columns_numpy if len(requests) > _NUMPY_MIN_REQUESTS else _columns_loop
    ids, positions, slots, query_start_loc, seq_lens, tables, num_decodes, max_query_len = build(
        requests, block_size
    )
    query_start_loc_cpu = _as_list(query_start_loc)
    token_rope_lengths = None
    if rope_lengths is not None:
        query_lens = np.diff(np.asarray(query_start_loc_cpu))
        token_rope_lengths = np.repeat(np.asarray(rope_lengths, np.int64), query_lens)
    metadata = AttentionMetadata(
        num_actual_tokens=int(query_start_loc[-1]),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=max_query_len,
        max_seq_len=int(max(seq_lens)),
        query_start_loc=_to(query_start_loc, torch.int32, device),
        seq_lens=_to(seq_lens, torch.int32, device),
        block_tables=_to(tables, torch.int32, device),
        slot_mapping=_to(slots, torch.int64, device),
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens_cpu=_as_list(seq_lens),
        rope_lengths=(
            None if token_rope_lengths is None else _to(token_rope_lengths, torch.int64, device)
        ),
    )
    return StepInputs(
        input_ids=_to(ids, torch.int64, device),
        positions=_to(positions, torch.int64, device),
        attn_metadata=metadata,
        query_start_loc_cpu=query_start_loc_cpu,
    )


# Above this many requests in a step, the numpy path is the faster (measured on the CPU,
# decode steps: level at 16, the loop up to 30 us faster at 4 to 8).
_NUMPY_MIN_REQUESTS = 16

# (input ids, positions, slots, query_start_loc, seq_lens, padded tables, num_decodes,
# max_query_len): the columns as lists (the loop) or arrays of the tensors' dtypes (numpy).
_Columns = tuple[Any, Any, Any, Any, Any, Any, int, int]


def _columns_loop(requests: list[tuple[list[int], int, list[int]]], block_size: int) -> _Columns:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    num_decodes = 0
    for token_ids, num_computed, block_table in requests:
        num_new = len(token_ids)
        if num_new == 1 and num_decodes == len(seq_lens):
            num_decodes += 1
        input_ids.extend(token_ids)
        for pos in range(num_computed, num_computed + num_new):
            positions.append(pos)
            slots.append(block_table[pos // block_size] * block_size + pos % block_size)
        query_start_loc.append(query_start_loc[-1] + num_new)
        seq_lens.append(num_computed + num_new)
    max_blocks = max(len(table) for _, _, table in requests)
    tables = [table + [0] * (max_blocks - len(table)) for _, _, table in requests]
    max_query_len = max(b - a for a, b in itertools.pairwise(query_start_loc))
    columns = input_ids, positions, slots, query_start_loc, seq_lens, tables
    return (*columns, num_decodes, max_query_len)


def _columns_numpy(requests: list[tuple[list[int], int, list[int]]], block_size: int) -> _Columns:
    num_reqs = len(requests)
    token_id_lists, computed, block_tables = zip(*requests)  # three tuples, in C
    input_ids = np.asarray(list(itertools.chain.from_iterable(token_id_lists)), np.int64)
    query_lens = np.fromiter(map(len, token_id_lists), np.int64, num_reqs)
    num_computed = np.array(computed, np.int64)
    num_decodes = 0  # requests with one new token, before the first with more
    if query_lens[0] == 1:
        longer = np.flatnonzero(query_lens != 1)
        num_decodes = int(longer[0]) if len(longer) else num_reqs
    query_start_loc = np.zeros(num_reqs + 1, np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
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
    seq_lens = (num_computed + query_lens).astype(np.int32)
    columns = input_ids, positions, slots, query_start_loc.astype(np.int32), seq_lens, tables
    return (*columns, num_decodes, int(query_lens.max()))


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


def _to(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list, or an array of `dtype`, as a tensor on `device` (an array on the CPU:
    shared, not copied)."""
    if isinstance(values, np.ndarray):
        return torch.from_numpy(values).to(device)
    return torch.tensor(values, dtype=dtype, device=device)


def _as_list(values: Any) -> list[int]:
    return values.tolist() if isinstance(values, np.ndarray) else values
