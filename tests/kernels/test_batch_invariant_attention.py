"""Batch-invariant paged attention (kernels/batch_invariant_attention.py): one request's
rows have the same bits prefilled whole, in chunks, decoded one at a time, and beside other
requests' decodes and chunks; the result is `paged_attention`'s reference within tolerance.
In the interpreter on the CPU, natively on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.batch_invariant_attention import invariant_attention
from kernels.reference import ref_paged_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 16, 8, 40


def _setup(seed: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    # each request owns blocks in a shuffled order: the table, not the layout, gives positions
    tables = torch.randperm(NUM_BLOCKS, generator=gen).to(torch.int32).view(4, 10)
    return kv_cache.to(DEVICE, dtype), tables.to(DEVICE), gen


def _attend(query, kv_cache, tables, spans, **options):
    """`spans`: (table row, first position, one past the last) per request, rows in order."""
    lens = [end - start for _, start, end in spans]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return invariant_attention(
        query,
        kv_cache,
        tables[[row for row, _, _ in spans]].contiguous(),
        torch.tensor([end for _, _, end in spans], dtype=torch.int32, device=DEVICE),
        qsl.to(DEVICE),
        scale=HEAD_DIM**-0.5,
        **options,
    )


OPTIONS = [
    pytest.param({}, id="plain"),
    pytest.param({"sliding_window": 37, "logits_soft_cap": 5.0}, id="window-softcap"),
    pytest.param({"sinks": "yes"}, id="sinks"),
]


@pytest.mark.parametrize("options", OPTIONS)
def test_rows_have_the_same_bits_in_any_chunk_or_batch(options: dict) -> None:
    kv_cache, tables, gen = _setup(1)
    if "sinks" in options:
        options = {"sinks": torch.randn(NUM_HEADS, generator=gen).to(DEVICE)}
    seq = 70  # request 0: positions 0..69, across several 64-key steps
    queries = torch.randn(seq, NUM_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    whole = _attend(queries, kv_cache, tables, [(0, 0, seq)], **options)
    want = ref_paged_attention(
        queries, kv_cache, tables[:1], torch.tensor([seq]), torch.tensor([0, seq]),
        HEAD_DIM**-0.5, **options,
    )  # fmt: skip
    torch.testing.assert_close(whole, want, atol=1e-5, rtol=1e-5)
    # Chunks of 7 from every offset, and the chunk that starts at the second 64-key tile
    # (the 64-chunk before it, rows 0..63, adds only a launch of 64 rows to the interpreter's
    # time: its rows are covered by the 7-chunks).
    chunks = [(start, min(start + 7, seq)) for start in range(0, seq, 7)] + [(64, seq)]
    for start, end in chunks:
        got = _attend(queries[start:end], kv_cache, tables, [(0, start, end)], **options)
        assert torch.equal(got, whole[start:end]), (start, end)
    for pos in (0, 63, 64, 69):  # decoded: a one-token chunk
        got = _attend(queries[pos : pos + 1], kv_cache, tables, [(0, pos, pos + 1)], **options)
        assert torch.equal(got, whole[pos : pos + 1]), pos
    # beside two decodes (first, as the engine orders them) and another request's chunk
    pos = 45
    others = torch.randn(2 + 9, NUM_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    batch = torch.cat([others[:2], queries[pos : pos + 6], others[2:]])
    spans = [(1, 30, 31), (2, 3, 4), (0, pos, pos + 6), (3, 20, 29)]
    got = _attend(batch, kv_cache, tables, spans, **options)
    assert torch.equal(got[2:8], whole[pos : pos + 6])


def test_a_16_bit_cache_is_read_alike() -> None:
    kv_cache, tables, gen = _setup(2, torch.float16)
    queries = torch.randn(9, NUM_HEADS, HEAD_DIM, generator=gen).to(DEVICE, torch.float16)
    whole = _attend(queries, kv_cache, tables, [(1, 0, 9)])
    decoded = torch.cat(
        [_attend(queries[i : i + 1], kv_cache, tables, [(1, i, i + 1)]) for i in range(9)]
    )
    assert torch.equal(decoded, whole)
    want = ref_paged_attention(
        queries.float(), kv_cache.float(), tables[1:2], torch.tensor([9]),
        torch.tensor([0, 9]), HEAD_DIM**-0.5,
    )  # fmt: skip
    torch.testing.assert_close(whole.float(), want, atol=2e-3, rtol=2e-3)


def test_cuda_graph_padding_rows_leave_the_real_rows_alone() -> None:
    """A captured decode graph pads the batch with one-token requests at position 0 over a
    block of their own (engine/worker/cuda_graphs.py): the real rows keep their bits."""
    kv_cache, tables, gen = _setup(3)
    queries = torch.randn(3, NUM_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    spans = [(0, 40, 41), (1, 12, 13), (2, 66, 67)]
    eager = _attend(queries, kv_cache, tables, spans)
    pad_table = torch.zeros(1, 10, dtype=torch.int32, device=DEVICE)
    pad_table[0, 0] = NUM_BLOCKS - 1
    padded_tables = torch.cat([tables, pad_table])
    padding = torch.randn(5, NUM_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    padded = _attend(
        torch.cat([queries, padding]), kv_cache, padded_tables, spans + [(4, 0, 1)] * 5
    )
    assert torch.equal(padded[:3], eager)
