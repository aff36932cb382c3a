"""The static inputs of the decode CUDA graphs (DecodeInputBuffers), on CPU tensors.

A captured graph reads fixed addresses, so each step must update the same tensors in place,
and a graph of a larger size than the step must read valid padding in its spare rows. The
buffers' state must depend only on the last step loaded, whatever steps came before (a
stale block id left by a wider or larger step would let a padding row or a real row read
another request's cache)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.worker.cuda_graphs import DecodeInputBuffers
from engine.worker.inputs import build_step_inputs

BLOCK_SIZE = 4
MAX_BATCH, MAX_BLOCKS, PAD_BLOCK = 8, 6, 40


def _buffers() -> DecodeInputBuffers:
    return DecodeInputBuffers(MAX_BATCH, MAX_BLOCKS, PAD_BLOCK, BLOCK_SIZE, torch.device("cpu"))


def _decode_step(rng: random.Random, num_reqs: int):
    """A pure decode step: each request has 1..MAX_BLOCKS blocks and one new token."""
    requests = []
    for _ in range(num_reqs):
        num_blocks = rng.randint(1, MAX_BLOCKS)
        table = rng.sample(range(PAD_BLOCK), num_blocks)
        num_computed = rng.randint((num_blocks - 1) * BLOCK_SIZE, num_blocks * BLOCK_SIZE - 1)
        requests.append(([rng.randrange(100)], num_computed, table))
    return build_step_inputs(requests, BLOCK_SIZE, torch.device("cpu"))


def _state(buffers: DecodeInputBuffers) -> list[torch.Tensor]:
    return [
        buffers.input_ids.clone(),
        buffers.positions.clone(),
        buffers.slot_mapping.clone(),
        buffers.seq_lens.clone(),
        buffers.query_start_loc.clone(),
        buffers.block_tables.clone(),
    ]


def test_rows_past_the_step_are_padding() -> None:
    buffers = _buffers()
    step = build_step_inputs(
        [([5], 6, [3, 9]), ([7], 0, [11]), ([8], 12, [1, 2, 4, 6])], BLOCK_SIZE, torch.device("cpu")
    )
    assert buffers.load(step) == 3
    assert buffers.input_ids[:4].tolist() == [5, 7, 8, 0]
    assert buffers.positions[:4].tolist() == [6, 0, 12, 0]
    # slot = block_table[pos // 4] * 4 + pos % 4; padding writes the padding block's slot 0
    assert buffers.slot_mapping[:4].tolist() == [9 * 4 + 2, 11 * 4, 6 * 4, PAD_BLOCK * 4]
    assert buffers.seq_lens[:4].tolist() == [7, 1, 13, 1]
    assert buffers.block_tables[:4].tolist() == [
        [3, 9, 0, 0, 0, 0],
        [11, 0, 0, 0, 0, 0],
        [1, 2, 4, 6, 0, 0],
        [PAD_BLOCK, 0, 0, 0, 0, 0],
    ]
    assert buffers.query_start_loc.tolist() == list(range(MAX_BATCH + 1))


def test_metadata_views_the_buffers_that_load_updates() -> None:
    """A graph captured over `metadata(size)` sees every later load: same storage."""
    buffers = _buffers()
    addresses = [t.data_ptr() for t in _state_tensors(buffers)]
    metadata = buffers.metadata(4, max_seq_len=24)
    assert metadata.seq_lens.data_ptr() == buffers.seq_lens.data_ptr()
    assert metadata.block_tables.data_ptr() == buffers.block_tables.data_ptr()
    assert metadata.slot_mapping.data_ptr() == buffers.slot_mapping.data_ptr()
    assert metadata.num_decodes == metadata.num_reqs == metadata.num_actual_tokens == 4
    assert metadata.max_seq_len == 24 and metadata.seq_lens_cpu == [24] * 4  # bounds
    buffers.load(_decode_step(random.Random(0), 3))
    assert [t.data_ptr() for t in _state_tensors(buffers)] == addresses
    assert metadata.seq_lens.tolist()[:3] == buffers.seq_lens[:3].tolist()
    assert metadata.seq_lens.tolist()[3] == 1  # the padding row, seen through the view


def _state_tensors(buffers: DecodeInputBuffers) -> list[torch.Tensor]:
    return [buffers.input_ids, buffers.positions, buffers.slot_mapping, buffers.seq_lens,
            buffers.query_start_loc, buffers.block_tables]  # fmt: skip


@pytest.mark.parametrize("seed", range(5))
def test_state_depends_only_on_the_last_step(seed: int) -> None:
    """Random sequences of steps of any size and width: after each, the buffers equal fresh
    buffers that loaded only that step (shrinking steps reset rows, narrower ones zero the
    stale table columns)."""
    rng = random.Random(seed)
    buffers = _buffers()
    for _ in range(12):
        step = _decode_step(rng, rng.randint(1, MAX_BATCH))
        buffers.load(step)
        fresh = _buffers()
        fresh.load(step)
        for got, want in zip(_state(buffers), _state(fresh)):
            assert torch.equal(got, want)


def test_a_step_larger_than_the_buffers_is_refused() -> None:
    buffers = _buffers()
    with pytest.raises(ValueError, match="exceeds the graph buffers"):
        buffers.load(_decode_step(random.Random(1), MAX_BATCH + 1))
    wide_table = list(range(MAX_BLOCKS + 1))
    wide = build_step_inputs([([1], 0, wide_table)], BLOCK_SIZE, torch.device("cpu"))
    with pytest.raises(ValueError, match="exceeds the graph buffers"):
        buffers.load(wide)
