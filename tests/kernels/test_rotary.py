"""Rotary embedding kernel vs. the torch reference, and the cos/sin cache builder."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import apply_rotary, build_cos_sin_cache, ref_rotary, rope_inv_freq
from tests.kernels._helpers import DTYPES, TOLERANCES, device, pick

LLAMA3_SCALING = {
    "rope_type": "llama3",
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
    cache = build_cos_sin_cache(head_dim, max_position, 500000.0, LLAMA3_SCALING).to(device())
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
    cache = build_cos_sin_cache(64, 50, 10000.0).to(device())
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
    cache = build_cos_sin_cache(head_dim, 10, theta)
    assert cache.shape == (10, head_dim) and cache.dtype == torch.float32
    for i in range(head_dim // 2):
        angle = 7 * theta ** (-2 * i / head_dim)
        assert cache[7, i].item() == pytest.approx(math.cos(angle), abs=1e-5)
        assert cache[7, head_dim // 2 + i].item() == pytest.approx(math.sin(angle), abs=1e-5)


def test_llama3_scaling_piecewise() -> None:
    """High frequencies kept, low ones divided by `factor`, the band between blended."""
    head_dim, theta = 128, 500000.0
    plain = rope_inv_freq(head_dim, theta)
    scaled = rope_inv_freq(head_dim, theta, LLAMA3_SCALING)
    wavelength = 2 * math.pi / plain
    high_edge = 8192 / LLAMA3_SCALING["high_freq_factor"]  # shorter wavelengths: unchanged
    low_edge = 8192 / LLAMA3_SCALING["low_freq_factor"]  # longer wavelengths: / factor
    short, long = wavelength < high_edge, wavelength > low_edge
    assert short.any() and long.any() and (~short & ~long).any()
    torch.testing.assert_close(scaled[short], plain[short])
    torch.testing.assert_close(scaled[long], plain[long] / 8.0)
    between = ~short & ~long
    assert torch.all(scaled[between] < plain[between])
    assert torch.all(scaled[between] > plain[between] / 8.0)


def test_rope_parameters_dict_matches_transformers() -> None:
    """The transformers 5 `rope_parameters` form (theta inside the dict) gives HF's values."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_parameters = {**LLAMA3_SCALING, "rope_theta": 500000.0}
    config = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters=rope_parameters,
    )
    hf_inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert attention_factor == 1.0
    ours = rope_inv_freq(128, 500000.0, rope_parameters)
    torch.testing.assert_close(ours, hf_inv_freq.float(), atol=0, rtol=1e-6)
    cache = build_cos_sin_cache(128, 300, rope_scaling=rope_parameters)
    angles = 299 * hf_inv_freq.float()
    torch.testing.assert_close(cache[299], torch.cat([angles.cos(), angles.sin()]))


def test_unsupported_rope_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        build_cos_sin_cache(64, 10, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="rope_theta is required"):
        build_cos_sin_cache(64, 10)
