"""The step inputs (engine/worker/inputs.py): the numpy path over the batch and the
per-token loop give the same columns, and both match slots worked out by hand."""

from __future__ import annotations

import random

import numpy as np
import torch

from engine.worker import inputs
from engine.worker.inputs import build_step_inputs


def _batch(rng: random.Random, block_size: int) -> list[tuple[list[int], int, list[int]]]:
    """Decode rows (one token) first, then prefill chunks, as the runner orders them."""
    num_reqs = rng.randint(1, 40)
    num_decodes = rng.randint(0, num_reqs)
    batch = []
    for i in range(num_reqs):
        num_new = 1 if i < num_decodes else rng.randint(1, 9)
        num_computed = rng.randint(0, 40)
        num_blocks = -(-(num_computed + num_new) // block_size) + rng.randint(0, 2)
        table = rng.sample(range(1, 500), num_blocks)
        batch.append(([rng.randint(0, 99) for _ in range(num_new)], num_computed, table))
    return batch


def _plain(values: object) -> object:
    return values.tolist() if isinstance(values, np.ndarray) else values


def test_numpy_columns_match_the_loop() -> None:
    rng = random.Random(0)
    for _ in range(200):
        block_size = rng.choice([1, 4, 16])
        batch = _batch(rng, block_size)
        loop = inputs._columns_loop(batch, block_size)
        vectorised = inputs._columns_numpy(batch, block_size)
        assert [_plain(c) for c in vectorised] == [_plain(c) for c in loop], batch


def test_slots_and_metadata_by_hand() -> None:
    """The docstring's example (block table [7, 2], block size 4, positions 0..5) as a
    prefill chunk after 20 decode rows, so the numpy path builds it."""
    decodes = [([30 + i], 3 + i % 5, [i + 10, i + 40]) for i in range(20)]
    batch = [*decodes, ([1, 2, 3, 4, 5, 6], 0, [7, 2])]
    assert len(batch) > inputs._NUMPY_MIN_REQUESTS
    step = build_step_inputs(batch, 4, torch.device("cpu"), rope_lengths=[9] * 21)
    meta = step.attn_metadata
    assert meta.slot_mapping[20:].tolist() == [28, 29, 30, 31, 8, 9]
    # Decode row i computes position p = 3 + i % 5: block p // 4 of [i + 10, i + 40].
    pos = [3 + i % 5 for i in range(20)]
    expected = [[i + 10, i + 40][p // 4] * 4 + p % 4 for i, p in enumerate(pos)]
    assert meta.slot_mapping[:20].tolist() == expected
    assert step.positions.tolist() == [*pos, 0, 1, 2, 3, 4, 5]
    assert step.input_ids.tolist() == [30 + i for i in range(20)] + [1, 2, 3, 4, 5, 6]
    assert meta.num_decodes == 20 and meta.num_actual_tokens == 26
    assert meta.query_start_loc_cpu == [*range(21), 26]
    assert meta.seq_lens_cpu == [p + 1 for p in pos] + [6]
    assert meta.max_query_len == 6 and meta.max_seq_len == 8
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.shape == (21, 2)
    assert meta.seq_lens.dtype == torch.int32 and meta.query_start_loc.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64 and step.input_ids.dtype == torch.int64
    assert meta.rope_lengths is not None and meta.rope_lengths.tolist() == [9] * 26
