"""TritonAttentionBackend on a mixed decode+prefill batch vs. a straightforward reference."""

from __future__ import annotations

import pytest
import torch

from engine.attention.backend import AttentionMetadata, AttentionParams, get_attention_backend
from engine.attention.triton_backend import TritonAttentionBackend
from kernels import ref_paged_attention, ref_write_kv_cache
from tests.kernels._helpers import DTYPES, TOLERANCES, device, make_paged_batch, mixed_batch_lens


def _metadata(query_lens: list[int], seq_lens: list[int], block_tables, block_size, pad: int):
    """Metadata for the batch plus `pad` padding tokens at the end (slot -1)."""
    dev = device()
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    slots = []
    for req, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(seq_len - q_len, seq_len):
            block = int(block_tables[req, pos // block_size])
            slots.append(block * block_size + pos % block_size)
    slots += [-1] * pad
    return AttentionMetadata(
        num_actual_tokens=starts[-1],
        num_decodes=query_lens.count(1),
        num_decode_tokens=query_lens.count(1),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_reference_on_mixed_batch(dtype: torch.dtype) -> None:
    query_lens, seq_lens = mixed_batch_lens()
    assert query_lens[0] == 1 and query_lens[-1] > 1  # decodes first, then prefills
    num_heads, num_kv_heads, head_dim, block_size, pad = 6, 2, 64, 16, 0  # nothing pads
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    metadata = _metadata(query_lens, seq_lens, batch.block_tables, block_size, pad)
    num_tokens = metadata.num_actual_tokens + pad
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(device())
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device())
    value = torch.randn_like(key)
    scale = head_dim**-0.5
    expected_cache = batch.kv_cache.clone()
    ref_write_kv_cache(key, value, expected_cache, metadata.slot_mapping)
    expected = ref_paged_attention(
        query,
        expected_cache,
        batch.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        scale,
    )

    backend = get_attention_backend("triton", device())
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "triton"
    out = backend.forward(query, key, value, batch.kv_cache, metadata, AttentionParams(scale))

    torch.testing.assert_close(batch.kv_cache, expected_cache, atol=0, rtol=0)
    assert out.shape == (num_tokens, num_heads, head_dim)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_needs_cuda_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU; use attention_backend='torch'"):
        TritonAttentionBackend(torch.device("cpu"))
