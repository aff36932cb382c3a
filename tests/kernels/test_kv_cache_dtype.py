"""The Triton KV write and paged attention with a 16-bit KV cache (`kv_cache_dtype`) under a
wider model dtype: keys/values rounded to the cache dtype on the store, the cache converted to
the query's dtype as it is loaded. References: torch's `.to()` rounding, and
ref_paged_attention computed from the cache as stored (widened to fp32)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.backend import AttentionParams
from engine.attention.triton_backend import TritonAttentionBackend
from kernels import paged_attention, ref_paged_attention, write_kv_cache
from tests.kernels._helpers import (
    TOLERANCES,
    device,
    make_paged_batch,
    mixed_batch_lens,
    requires_cuda,
)
from tests.model_utils import build_attn_metadata

# (query/model dtype, cache dtype). The interpreter widens bf16 exactly but rounds fp32 ->
# bf16 stores wrongly (tests/kernels/_helpers.py), so bf16 stores are checked on a GPU.
PAIRS = [
    pytest.param(torch.float32, torch.float16, id="fp32-fp16"),
    pytest.param(torch.float32, torch.bfloat16, id="fp32-bf16"),
    pytest.param(torch.bfloat16, torch.float16, id="bf16-fp16", marks=requires_cuda),
]
STORE_PAIRS = [
    pytest.param(torch.float32, torch.float16, id="fp32-fp16"),
    pytest.param(torch.float32, torch.bfloat16, id="fp32-bf16", marks=requires_cuda),
    pytest.param(torch.bfloat16, torch.float16, id="bf16-fp16", marks=requires_cuda),
]


@pytest.mark.parametrize("model_dtype,cache_dtype", STORE_PAIRS)
def test_write_rounds_to_the_cache_dtype(model_dtype, cache_dtype):
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, 2 + 2 * 3, 16, generator=gen) * torch.logspace(-3, 3, 16)
    qkv = qkv.to(model_dtype).to(device())
    key, value = qkv[:, 2:5], qkv[:, 5:8]  # strided views, as the model passes them
    slot_mapping = torch.tensor([5, 7, -1, 0, 11, 2, 9], device=device())
    cache = torch.zeros(2, 3, 4, 3, 16, dtype=cache_dtype, device=device())
    write_kv_cache(key, value, cache, slot_mapping)
    flat = cache.view(2, 12, 3, 16)
    used = slot_mapping >= 0
    assert torch.equal(flat[0, slot_mapping[used]], key[used].to(cache_dtype))
    assert torch.equal(flat[1, slot_mapping[used]], value[used].to(cache_dtype))
    assert not flat[:, [1, 3, 4, 6, 8, 10]].any()  # nothing else written


@pytest.mark.parametrize("query_dtype,cache_dtype", PAIRS)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,sliding_window,logits_soft_cap",
    [(6, 2, None, None), (8, 1, None, None), (4, 2, 7, None), (4, 4, None, 3.0)],
    ids=["gqa", "mqa", "window", "soft-cap"],
)
def test_attention_reads_a_16_bit_cache(
    query_dtype, cache_dtype, num_heads, num_kv_heads, sliding_window, logits_soft_cap
):
    query_lens, seq_lens = mixed_batch_lens()  # decodes, then prefills after cached context
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        block_size=16,
        dtype=query_dtype,
    )
    cache = batch.kv_cache.to(cache_dtype)
    scale = 32**-0.5
    out = paged_attention(
        batch.query,
        cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        scale=scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    expected = ref_paged_attention(
        batch.query,
        cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        scale,
        logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window,
    )
    assert out.dtype == query_dtype
    torch.testing.assert_close(out, expected, **TOLERANCES[query_dtype])


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_backend_step_with_an_fp32_model(cache_dtype):
    """The backend's write-then-attend on a step with decodes and a chunk after cached
    tokens: the attention sees exactly the rounded keys/values the write stored."""
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 16
    tables = [[3, 9], [0, 5, 7, 2], [11, 1, 4]]
    requests = [(5, 1, tables[0]), (12, 1, tables[1]), (6, 5, tables[2])]
    metadata = build_attn_metadata(requests, block_size=block_size, device=device())
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 12, block_size, num_kv_heads, head_dim, generator=gen)
    cache = cache.to(cache_dtype).to(device())
    num_tokens = metadata.num_actual_tokens
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(device())
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device())
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device())
    backend = TritonAttentionBackend(device())
    out = backend.forward(query, key, value, cache, metadata, AttentionParams(0.25))
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    stored = flat[0, metadata.slot_mapping].float()
    # Rounded as torch rounds; the interpreter's bf16 stores within one unit in the last
    # place (see STORE_PAIRS).
    exact = cache_dtype == torch.float16 or torch.cuda.is_available()
    rtol = 0.0 if exact else torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(stored, key.to(cache_dtype).float(), atol=0, rtol=rtol)
    expected = ref_paged_attention(
        query,
        cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        0.25,
    )
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


def test_launchers_name_the_cache_dtypes_they_take():
    batch = make_paged_batch(
        [1], [5], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4, dtype=torch.float16
    )
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc)
    kwargs = dict(max_query_len=1, max_seq_len=5, scale=1.0)
    # A cache wider than the query, or not a float, is refused.
    for cache in (batch.kv_cache.float(), batch.kv_cache.to(torch.int16)):
        with pytest.raises(ValueError, match="kv_cache"):
            paged_attention(batch.query, cache, *args, **kwargs)
    key = torch.zeros(1, 1, 16, device=device())
    slots = torch.zeros(1, dtype=torch.int64, device=device())
    with pytest.raises(ValueError, match="kv_cache dtype"):
        write_kv_cache(key.half(), key.half(), batch.kv_cache.float(), slots)
    with pytest.raises(ValueError, match="key must have dtype"):
        write_kv_cache(key.long(), key.long(), batch.kv_cache, slots)
