"""The Triton KV write and paged attention with an FP8 (E4M3) KV cache and per-tensor scales
(kv_cache_dtype="fp8", vLLM's scheme). References: torch's
`(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)` for the bytes written, and
ref_paged_attention over the cache dequantized in fp32 (`stored.float() * scale`)."""

from __future__ import annotations

import pytest
import torch

from kernels import (
    flash_prefill,
    paged_attention,
    ref_paged_attention,
    rotary_write_kv_cache,
    write_kv_cache,
)
from tests.kernels._helpers import TOLERANCES, device, make_paged_batch, mixed_batch_lens

FP8 = torch.float8_e4m3fn


def _quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-448, 448).to(FP8)


@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.037, 2.5)])
def test_write_quantizes_as_torch(k_scale, v_scale, scale_kind):
    gen = torch.Generator().manual_seed(0)
    # Magnitudes from 1e-4 to 1e4: subnormals, every binade, and values clamped at 448.
    qkv = torch.randn(7, 2 + 2 * 3, 16, generator=gen) * torch.logspace(-4, 4, 16)
    qkv = qkv.to(device())
    key, value = qkv[:, 2:5], qkv[:, 5:8]  # strided views, as the model passes them
    slot_mapping = torch.tensor([5, 7, -1, 0, 11, 2, 9], device=device())
    cache = torch.zeros(2, 3, 4, 3, 16, dtype=FP8, device=device())
    scales = (k_scale, v_scale)
    if scale_kind == "tensor":
        scales = tuple(torch.tensor([s], device=device()) for s in scales)
    write_kv_cache(key, value, cache, slot_mapping, k_scale=scales[0], v_scale=scales[1])
    flat = cache.view(2, 12, 3, 16).view(torch.uint8)  # compare the bytes
    used = slot_mapping >= 0
    assert torch.equal(flat[0, slot_mapping[used]], _quantize(key[used], k_scale).view(torch.uint8))
    assert torch.equal(
        flat[1, slot_mapping[used]], _quantize(value[used], v_scale).view(torch.uint8)
    )
    assert not flat[:, [1, 3, 4, 6, 8, 10]].any()  # nothing else written
    assert (flat[0, slot_mapping[used]].view(FP8).float().abs() == 448).any()  # clamped


def test_write_rounds_ties_to_even():
    # Values halfway between E4M3 neighbours (and ones that carry into the next binade).
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # non-negative finite
    mids = (grid[:-1] + grid[1:]) / 2
    x = torch.cat([mids, -mids, grid, torch.zeros(5)]).reshape(-1, 1, 16).to(device())
    n = x.shape[0]
    cache = torch.zeros(2, n, 1, 1, 16, dtype=FP8, device=device())
    slots = torch.arange(n, device=device())
    write_kv_cache(x, x, cache, slots)
    assert torch.equal(cache[0].view(torch.uint8).reshape(n, 16), x.to(FP8).view(torch.uint8)[:, 0])


@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
def test_fused_rotary_write_quantizes_the_rotated_keys(scale_kind):
    """The fused rotary + KV write stores the rotated keys (as left in `qk`) and the values
    quantized exactly as torch quantizes them."""
    num_heads, num_kv_heads, head_dim, k_scale, v_scale = 2, 2, 16, 0.01, 3.0
    gen = torch.Generator().manual_seed(5)
    angles = torch.rand(5, 1, head_dim // 2, generator=gen) * 6.0
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(device())
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1).to(device())
    qk = torch.randn(5, num_heads + num_kv_heads, head_dim, generator=gen) * 4
    value = torch.randn(5, num_kv_heads, head_dim, generator=gen) * torch.logspace(-3, 3, 16)
    qk, value = qk.to(device()), value.to(device())
    kv_cache = torch.zeros(2, 2, 4, num_kv_heads, head_dim, dtype=FP8, device=device())
    slots = torch.tensor([6, -1, 0, 3, 7], device=device())
    scales = (k_scale, v_scale)
    if scale_kind == "tensor":
        scales = tuple(torch.tensor([s], device=device()) for s in scales)
    rotary_write_kv_cache(
        qk, value, cos, sin, kv_cache, slots, num_heads, k_scale=scales[0], v_scale=scales[1]
    )
    flat = kv_cache.view(2, 8, num_kv_heads, head_dim).view(torch.uint8)
    used = slots >= 0
    keys = qk[used, num_heads:]  # rotated in place
    assert torch.equal(flat[0, slots[used]], _quantize(keys, k_scale).view(torch.uint8))
    assert torch.equal(flat[1, slots[used]], _quantize(value[used], v_scale).view(torch.uint8))
    assert not flat[:, [1, 2, 4, 5]].any()


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,sliding_window,num_splits",
    [(6, 2, None, 1), (8, 1, None, 3), (4, 2, 7, 1)],
    ids=["gqa", "mqa-split", "window"],
)
def test_attention_dequantizes_the_cache(num_heads, num_kv_heads, sliding_window, num_splits):
    query_lens, seq_lens = mixed_batch_lens()  # decodes, then prefills after cached context
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
    )
    k_scale, v_scale = 0.02, 0.5
    cache = torch.stack(
        [_quantize(batch.kv_cache[0], k_scale), _quantize(batch.kv_cache[1], v_scale)]
    )
    dequantized = torch.stack([cache[0].float() * k_scale, cache[1].float() * v_scale])
    scale = 32**-0.5
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc)
    kwargs = dict(max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, scale=scale)
    scales = (k_scale, v_scale)
    if num_splits > 1:  # 1-element tensors, read on the device
        scales = tuple(torch.tensor([s], device=device()) for s in scales)
    out = paged_attention(
        batch.query,
        cache,
        *args,
        **kwargs,
        sliding_window=sliding_window,
        num_splits=None if sliding_window else num_splits,
        k_scale=scales[0],
        v_scale=scales[1],
    )
    expected = ref_paged_attention(
        batch.query, dequantized, *args, scale, sliding_window=sliding_window
    )
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    # The scales are applied: the cache read with scale 1 gives another answer.
    unscaled = paged_attention(batch.query, cache, *args, **kwargs, sliding_window=sliding_window)
    assert not torch.allclose(unscaled, expected, atol=1e-2)


@pytest.mark.parametrize("sliding_window", [None, 5], ids=["causal", "window"])
def test_flash_prefill_dequantizes_the_cache(sliding_window):
    batch = make_paged_batch(
        [24, 7, 3],
        [24, 45, 19],
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
    )
    k_scale, v_scale = 0.02, 0.5
    cache = torch.stack(
        [_quantize(batch.kv_cache[0], k_scale), _quantize(batch.kv_cache[1], v_scale)]
    )
    dequantized = torch.stack([cache[0].float() * k_scale, cache[1].float() * v_scale])
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc)
    scale = 32**-0.5
    out = flash_prefill(
        batch.query,
        cache,
        *args,
        max_query_len=batch.max_query_len,
        scale=scale,
        sliding_window=sliding_window,
        k_scale=torch.tensor([k_scale], device=device()),
        v_scale=torch.tensor([v_scale], device=device()),
    )
    expected = ref_paged_attention(
        batch.query, dequantized, *args, scale, sliding_window=sliding_window
    )
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


def test_launchers_without_scales_refuse_an_fp8_cache():
    from kernels.batch_invariant_attention import invariant_attention

    batch = make_paged_batch(
        [1], [5], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4, dtype=torch.float32
    )
    cache = batch.kv_cache.to(FP8)
    with pytest.raises(ValueError, match="kv_cache"):
        invariant_attention(
            batch.query, cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
            scale=1.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention(
            batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens,
            batch.query_start_loc, max_query_len=1, max_seq_len=5, scale=1.0, k_scale=0.0,
        )  # fmt: skip
