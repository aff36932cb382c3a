"""Rotary embedding kernel vs. the torch reference, and the cos/sin cache builder."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config.rope import RopeParameters
from engine.layers.rope import inv_freq
from kernels import apply_rotary, build_cos_sin_cache, ref_rotary
from tests.kernels._helpers import DTYPES, TOLERANCES, device, pick

LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3)])
def test_matches_reference(
    dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int
) -> None:
    num_tokens = pick(6, 3001)
    max_position = pick(200, 16384)
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    llama3 = RopeParameters(500000.0, "llama3", LLAMA3_SCALING)
    cache = build_cos_sin_cache(inv_freq(llama3, head_dim, max_position), max_position)
    cache = cache.to(device())
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen).to(device())
    # q and k as views of one fused QKV buffer, rotated in place.
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    qkv = qkv.to(dtype).to(device())
    query, key = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    value_before = qkv[:, num_heads + num_kv_heads :].clone()
    expected_query, expected_key = ref_rotary(positions, query, key, cache)

    apply_rotary(positions, query, key, cache)

    tol = TOLERANCES[dtype]
    torch.testing.assert_close(query, expected_query, **tol)
    torch.testing.assert_close(key, expected_key, **tol)
    torch.testing.assert_close(qkv[:, num_heads + num_kv_heads :], value_before, atol=0, rtol=0)


def test_position_zero_is_identity_and_norms_are_kept() -> None:
    cache = build_cos_sin_cache(inv_freq(RopeParameters(), 64, 50), 50).to(device())
    positions = torch.tensor([0, 0, 31, 49], device=device())
    query = torch.randn(4, 2, 64, device=device())
    key = torch.randn(4, 1, 64, device=device())
    query_before, key_before = query.clone(), key.clone()
    apply_rotary(positions, query, key, cache)
    torch.testing.assert_close(query[:2], query_before[:2], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(key[:2], key_before[:2], atol=1e-6, rtol=1e-6)
    # A rotation keeps each head's norm.
    torch.testing.assert_close(query.norm(dim=-1), query_before.norm(dim=-1))


def test_cache_layout_is_cos_then_sin() -> None:
    head_dim, theta = 8, 10000.0
    cache = build_cos_sin_cache(inv_freq(RopeParameters(theta), head_dim, 10), 10)
    assert cache.shape == (10, head_dim) and cache.dtype == torch.float32
    for i in range(head_dim // 2):
        angle = 7 * theta ** (-2 * i / head_dim)
        assert cache[7, i].item() == pytest.approx(math.cos(angle), abs=1e-5)
        assert cache[7, head_dim // 2 + i].item() == pytest.approx(math.sin(angle), abs=1e-5)


def test_cache_of_any_type_matches_transformers() -> None:
    """The kernel's cache from the engine's frequencies and attention factor (yarn here)
    holds transformers' cos/sin rows."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from engine.config.rope import rope_parameters

    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    config = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        head_dim=128,
        max_position_embeddings=256,
        rope_parameters={**rope, "rope_theta": 500000.0},
    )
    params = rope_parameters(config)
    factor = params.attention_factor(256)
    assert factor > 1.0
    cache = build_cos_sin_cache(inv_freq(params, 128, 256), 256, factor)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(256)[None])
    torch.testing.assert_close(cache[:, :64], cos[0, :, :64])
    torch.testing.assert_close(cache[:, 64:], sin[0, :, 64:])
