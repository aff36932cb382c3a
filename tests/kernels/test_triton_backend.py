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


def test_forward_rotary_fuses_what_the_torch_backend_does_in_steps() -> None:
    """The triton backend's one-launch rotary + KV write, then attention, against the torch
    backend's rotation, write and attention on the same mixed batch (fp32)."""
    from engine.layers.ops import apply_rotary_emb
    from engine.layers.rope import RotaryEmbedding

    query_lens, seq_lens = mixed_batch_lens()
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float32,
    )
    metadata = _metadata(query_lens, seq_lens, batch.block_tables, block_size, pad=0)
    num_tokens = metadata.num_actual_tokens
    positions = torch.cat(
        [torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)]
    ).to(device())
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    cos, sin = RotaryEmbedding(head_dim, 128, 10000.0, rope).cos_sin(positions, torch.float32)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    qkv = qkv.to(device())
    params = AttentionParams(head_dim**-0.5, sliding_window=20)
    torch_cache = batch.kv_cache.clone()
    want = get_attention_backend("torch", device()).forward_rotary(
        qkv[:, : num_heads + num_kv_heads].clone(), qkv[:, num_heads + num_kv_heads :],
        apply_rotary_emb, cos, sin, torch_cache, metadata, params, num_heads,
    )  # fmt: skip

    got = get_attention_backend("triton", device()).forward_rotary(
        qkv[:, : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :],
        apply_rotary_emb, cos, sin, batch.kv_cache, metadata, params, num_heads,
    )  # fmt: skip

    torch.testing.assert_close(batch.kv_cache, torch_cache, **TOLERANCES[torch.float32])
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])
