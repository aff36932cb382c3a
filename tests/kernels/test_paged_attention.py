"""Paged attention kernel vs. the torch reference over batch shapes, GQA, dims, dtypes."""

from __future__ import annotations

import pytest
import torch

from kernels import paged_attention, ref_paged_attention, split_kv
from tests.kernels._helpers import (
    DTYPES,
    TOLERANCES,
    PagedBatch,
    device,
    free_gpu_bytes,
    make_paged_batch,
    mixed_batch_lens,
    pick,
    requires_cuda,
)

# (num_heads, num_kv_heads): GQA ratios 1, 3 and 8 (MQA at small sizes).
HEAD_LAYOUTS = pick([(2, 2), (6, 2), (8, 1)], [(8, 8), (24, 8), (32, 4)])


def _batch_lens(kind: str) -> tuple[list[int], list[int]]:
    if kind == "decode":
        seq = pick([1, 16, 17, 47], [1, 16, 17, 255, 1023, 2047, 4001] * 4)
        return [1] * len(seq), seq
    if kind == "prefill":  # a full first chunk, a chunk after cached tokens, a few tokens
        return pick(([32, 9, 3], [32, 41, 3]), ([1024, 300, 5], [1024, 2000, 9]))
    return mixed_batch_lens()


def _check(
    batch: PagedBatch, num_splits: int | None = None, sinks: torch.Tensor | None = None
) -> None:
    scale = batch.query.shape[-1] ** -0.5
    out = paged_attention(
        batch.query,
        batch.kv_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        scale=scale,
        num_splits=num_splits,
        sinks=sinks,
    )
    expected = ref_paged_attention(
        batch.query,
        batch.kv_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        scale,
        sinks=sinks,
    )
    torch.testing.assert_close(out, expected, **TOLERANCES[batch.query.dtype])


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEAD_LAYOUTS)
def test_batch_shapes(kind: str, block_size: int, num_heads: int, num_kv_heads: int) -> None:
    query_lens, seq_lens = _batch_lens(kind)
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        block_size=block_size,
        dtype=torch.float16,
    )
    _check(batch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_head_dims_and_dtypes(head_dim: int, dtype: torch.dtype) -> None:
    query_lens, seq_lens = mixed_batch_lens()
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=pick(4, 32),
        num_kv_heads=pick(2, 8),
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
    )
    _check(batch)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_kv_matches_single_pass(num_splits: int) -> None:
    """Split-KV over decodes, and over a prefill chunk (splits whose keys a row cannot see)."""
    query_lens, seq_lens = pick(([1, 1, 6], [40, 129, 70]), ([1, 1, 1, 64], [3000, 17, 5000, 999]))
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=pick(4, 32),
        num_kv_heads=pick(2, 8),
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
    )
    _check(batch, num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kind", "num_splits"), [("mixed", None), ("decode", 3)])
def test_attention_sinks(kind: str, num_splits: int | None, dtype: torch.dtype) -> None:
    """GPT-OSS's sinks (a per-head logit in the softmax's sum): single pass and split-KV,
    where only the first split may count the sink."""
    query_lens, seq_lens = _batch_lens(kind)
    num_heads = pick(6, 32)
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=pick(2, 8),
        head_dim=64,
        block_size=16,
        dtype=dtype,
    )
    sinks = torch.randn(num_heads, device=batch.query.device).to(dtype)
    sinks[0] = 5.0  # a head whose sink takes most of the weight
    _check(batch, num_splits=num_splits, sinks=sinks)


def test_split_ranges_do_not_depend_on_max_seq_len() -> None:
    """A captured CUDA graph launches decode attention with max_seq_len = max_model_len
    (engine/worker/cuda_graphs.py): each request's walk must still be split over its own
    length, so the result is the same bits as with the exact bound (and the reference)."""
    query_lens, seq_lens = [1, 1, 1], pick([40, 129, 7], [3000, 17, 999])
    batch = make_paged_batch(
        query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32,
    )  # fmt: skip
    scale = 64**-0.5

    def run(max_seq_len: int) -> torch.Tensor:
        return paged_attention(
            batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens,
            batch.query_start_loc, max_query_len=1, max_seq_len=max_seq_len, scale=scale,
            num_splits=4,
        )  # fmt: skip

    exact = run(batch.max_seq_len)
    assert torch.equal(run(64 * batch.max_seq_len), exact)
    expected = ref_paged_attention(
        batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens,
        batch.query_start_loc, scale,
    )  # fmt: skip
    torch.testing.assert_close(exact, expected, **TOLERANCES[torch.float32])


def test_split_kv_chosen_only_when_decode_leaves_sms_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(split_kv, "_num_sms", lambda index: 132)  # an H100
    cuda = torch.device("cuda", 0)
    # 4 requests x 8 KV heads = 32 programs for 264 slots: 9 splits (long enough contexts).
    assert split_kv.choose_num_splits(cuda, 4, 8, max_query_len=1, max_seq_len=16384) == 9
    assert split_kv.choose_num_splits(cuda, 4, 8, max_query_len=1, max_seq_len=600) == 2
    assert split_kv.choose_num_splits(cuda, 1, 1, max_query_len=1, max_seq_len=10**6) == 16
    assert split_kv.choose_num_splits(cuda, 64, 8, max_query_len=1, max_seq_len=4096) == 1
    assert split_kv.choose_num_splits(cuda, 4, 8, max_query_len=7, max_seq_len=16384) == 1
    assert split_kv.choose_num_splits(torch.device("cpu"), 1, 1, 1, 16384) == 1


def test_two_launches_write_disjoint_rows_of_one_output() -> None:
    """How the backend calls it: decodes and prefills as separate launches into one `out`;
    `query_start_loc` need not start at 0, and rows outside a launch stay untouched."""
    query_lens, seq_lens = mixed_batch_lens()
    num_decodes = query_lens.count(1)
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
    )
    scale = 0.125
    sentinel = 7.0
    out = torch.full_like(batch.query, sentinel)
    paged_attention(
        batch.query,
        batch.kv_cache,
        batch.block_tables[num_decodes:],
        batch.seq_lens[num_decodes:],
        batch.query_start_loc[num_decodes:],
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        scale=scale,
        out=out,
    )
    assert torch.all(out[:num_decodes] == sentinel)
    paged_attention(
        batch.query[:num_decodes],
        batch.kv_cache,
        batch.block_tables[:num_decodes],
        batch.seq_lens[:num_decodes],
        batch.query_start_loc[: num_decodes + 1],
        max_query_len=1,
        max_seq_len=batch.max_seq_len,
        scale=scale,
        out=out[:num_decodes],
        num_splits=2,
    )
    expected = ref_paged_attention(
        batch.query,
        batch.kv_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        scale,
    )
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float16])


def test_strided_query_view() -> None:
    """The query may be a slice of a fused QKV projection (token stride > heads * dim)."""
    query_lens, seq_lens = [1, 5], [20, 37]
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
    )
    fused = torch.randn(batch.query.shape[0], 8, 32, device=batch.query.device)
    fused[:, :4] = batch.query
    batch.query = fused[:, :4]
    assert not batch.query.is_contiguous()
    _check(batch)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_block_offsets_beyond_int32(dtype: torch.dtype) -> None:
    """Blocks whose element offset block_id * block_stride exceeds 2^31 must be read right."""
    block_size, num_kv_heads, head_dim = 16, 1, 64
    block_stride = block_size * num_kv_heads * head_dim
    num_blocks = (2**31) // block_stride + 64
    cache_bytes = 2 * num_blocks * block_stride * dtype.itemsize
    if free_gpu_bytes() < cache_bytes + (2 << 30):
        pytest.skip(f"needs {cache_bytes / 2**30:.1f} GiB of free GPU memory")
    kv_cache = torch.empty(
        (2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device()
    )
    seq_lens = [40, 1, 33]
    query_lens = [1, 1, 20]
    # Only the last 8 blocks of the cache are used, in shuffled order; rows pad with 0.
    high = (torch.arange(num_blocks - 8, num_blocks)[torch.randperm(8)]).tolist()
    block_tables = torch.tensor(
        [high[0:3], [high[3], 0, 0], high[4:7]], dtype=torch.int32, device=device()
    )
    kv_cache[:, num_blocks - 8 :] = torch.randn_like(kv_cache[:, num_blocks - 8 :])
    kv_cache[:, 0] = 0
    small = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=4,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    batch = PagedBatch(
        query=small.query,
        kv_cache=kv_cache,
        block_tables=block_tables,
        seq_lens=small.seq_lens,
        query_start_loc=small.query_start_loc,
        max_query_len=small.max_query_len,
        max_seq_len=small.max_seq_len,
    )
    _check(batch)
    _check(batch, num_splits=3)
    del kv_cache, batch
    torch.cuda.empty_cache()
