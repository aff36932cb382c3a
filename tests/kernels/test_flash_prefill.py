"""The FlashAttention-2-style prefill kernel (kernels/flash_prefill.py) against the torch
reference: chunk boundaries, GQA, the three key ranges (window edge, full, diagonal), soft-cap,
sinks, a 16-bit cache under an fp32 model, and rows outside the launch left alone.

In the interpreter the kernel runs with 16 x 16 tiles, so a few dozen tokens already cross
several query tiles and every key range; on a GPU the autotuned tiles see larger batches."""

from __future__ import annotations

import pytest
import torch

from kernels import ref_paged_attention
from kernels.flash_prefill import flash_prefill
from tests.kernels._helpers import DTYPES, TOLERANCES, device, make_paged_batch, pick

# (query_lens, seq_lens): a whole first chunk, a later chunk after cached tokens (its first
# row mid-tile), a chunk of one token, a short prompt; contexts end mid-block.
PREFILL = pick(([24, 37, 1, 5], [24, 70, 51, 5]), ([2048, 512, 1, 77], [2048, 1100, 900, 77]))


def _run(batch, scale, **options) -> tuple[torch.Tensor, torch.Tensor]:
    got = flash_prefill(
        batch.query,
        batch.kv_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        max_query_len=batch.max_query_len,
        scale=scale,
        **options,
    )
    want = ref_paged_attention(
        batch.query,
        batch.kv_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        scale,
        **options,
    )
    return got, want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 1, 64, 16), (3, 3, 40, 8)],  # GQA 4:1; MHA with a padded head_dim, small blocks
)
def test_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    query_lens, seq_lens = PREFILL
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    got, want = _run(batch, head_dim**-0.5)
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])


@pytest.mark.parametrize(
    "options",
    [
        {"sliding_window": 9},  # shorter than a tile: every range masked
        {"sliding_window": 40},  # full tiles between the window's edge and the diagonal
        {"logits_soft_cap": 2.0},
        {"sinks": "random"},
    ],
    ids=["window-9", "window-40", "soft-cap", "sinks"],
)
def test_layer_options_match_reference(options: dict) -> None:
    query_lens, seq_lens = PREFILL
    num_heads = 4
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
        seed=5,
    )
    if options.get("sinks") == "random":
        gen = torch.Generator().manual_seed(9)
        options = {"sinks": (torch.randn(num_heads, generator=gen) * 2).to(device())}
    got, want = _run(batch, 0.2, **options)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


def test_16_bit_cache_under_an_fp32_model() -> None:
    query_lens, seq_lens = PREFILL
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
        seed=2,
    )
    batch.kv_cache = batch.kv_cache.half()
    got, want = _run(batch, 0.25)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


def test_prefill_rows_of_a_mixed_batch_only() -> None:
    """The backend's prefill launch: requests after the decodes, rows of `out` before them
    (the decode rows) untouched."""
    query_lens, seq_lens = [1, 1, 20, 6], [9, 30, 20, 40]
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=2,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
        seed=4,
    )
    out = torch.full_like(batch.query, 7.0)
    flash_prefill(
        batch.query,
        batch.kv_cache,
        batch.block_tables[2:],
        batch.seq_lens[2:],
        batch.query_start_loc[2:],
        max_query_len=20,
        scale=0.2,
        out=out,
    )
    want = ref_paged_attention(
        batch.query,
        batch.kv_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        0.2,
    )
    assert (out[:2] == 7.0).all()
    torch.testing.assert_close(out[2:], want[2:], **TOLERANCES[torch.float32])
