"""The rotary kernel over the engine's per-token cos/sin (kernels/rotary_kv.py), alone and
fused with the KV-cache write, for every rope type the engine computes tables for."""

from __future__ import annotations

import pytest
import torch

from engine.layers.ops import apply_rotary_emb
from engine.layers.rope import RotaryEmbedding
from kernels import (
    ref_rotary_cos_sin,
    ref_write_kv_cache,
    rotary_cos_sin_,
    rotary_write_kv_cache,
    write_kv_cache,
)
from tests.kernels._helpers import DTYPES, TOLERANCES, device

HEAD_DIM, MAX_POS, ORIGINAL = 32, 64, 16
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
    "long_factor": [1.0 + 0.6 * i for i in range(HEAD_DIM // 2)],
    "original_max_position_embeddings": ORIGINAL,
}
# Every type the engine supports, with a scaling that moves its table off the default one.
ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
        "mscale": 0.9,
        "mscale_all_dim": 0.6,
    },
    "longrope": LONGROPE,
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
}


def _cos_sin(rope: dict | None, positions: torch.Tensor, dtype: torch.dtype):
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POS, 10000.0, rope)
    # Rope lengths past both thresholds for some tokens: longrope's long table, dynamic's theta.
    lengths = torch.where(positions % 2 == 0, positions + 1, positions + 2 * MAX_POS)
    return rotary.cos_sin(positions, dtype, lengths)


@pytest.mark.parametrize("name", list(ROPES))
def test_every_rope_type_matches_the_reference(name: str) -> None:
    dtype = torch.float32
    gen = torch.Generator().manual_seed(len(name))
    positions = torch.tensor([0, 3, 15, 16, 40, 63], device=device())
    cos, sin = _cos_sin(ROPES[name], positions, dtype)
    num_heads, num_kv_heads = 3, 1
    qkv = torch.randn(6, num_heads + 2 * num_kv_heads, HEAD_DIM, generator=gen).to(device())
    qk = qkv[:, : num_heads + num_kv_heads]  # a strided view, as the layer hands it over
    value_before = qkv[:, num_heads + num_kv_heads :].clone()
    expected = ref_rotary_cos_sin(qk, cos, sin)
    torch_path = apply_rotary_emb(qk.clone(), cos, sin)  # the engine's torch rotation

    assert rotary_cos_sin_(qk, cos, sin) is qk

    torch.testing.assert_close(qk, expected, **TOLERANCES[dtype])
    torch.testing.assert_close(qk, torch_path, **TOLERANCES[dtype])
    torch.testing.assert_close(qkv[:, num_heads + num_kv_heads :], value_before, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_write_is_rotation_then_write(dtype: torch.dtype) -> None:
    num_heads, num_kv_heads, block_size, num_blocks = 6, 2, 4, 5
    gen = torch.Generator().manual_seed(7)
    positions = torch.tensor([2, 9, 17, 30, 5], device=device())
    cos, sin = _cos_sin(ROPES["llama3"], positions, dtype)
    qkv = torch.randn(5, num_heads + 2 * num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    qkv = qkv.to(device())
    qk, value = qkv[:, : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]
    slot_mapping = torch.tensor([3, 17, -1, 8, 19], dtype=torch.int64, device=device())
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, HEAD_DIM, generator=gen)
    kv_cache = kv_cache.to(dtype).to(device())

    # The unfused path: rotate, then write (the kernels each), and the fp32 reference.
    qk_unfused, cache_unfused = qk.clone(), kv_cache.clone()
    rotary_cos_sin_(qk_unfused, cos, sin)
    write_kv_cache(qk_unfused[:, num_heads:], value, cache_unfused, slot_mapping)
    expected_qk, expected_cache = ref_rotary_cos_sin(qk, cos, sin), kv_cache.clone()
    ref_write_kv_cache(expected_qk[:, num_heads:], value, expected_cache, slot_mapping)

    rotary_write_kv_cache(qk, value, cos, sin, kv_cache, slot_mapping, num_heads)

    torch.testing.assert_close(qk, qk_unfused, atol=0, rtol=0)
    torch.testing.assert_close(kv_cache, cache_unfused, atol=0, rtol=0)
    torch.testing.assert_close(qk, expected_qk, **TOLERANCES[dtype])
    torch.testing.assert_close(kv_cache, expected_cache, **TOLERANCES[dtype])


def test_fused_write_into_a_16_bit_cache() -> None:
    """An fp32 model with a 16-bit kv_cache_dtype: the rotated key is rounded to the cache's
    dtype on the store, as `write_kv_cache` rounds it."""
    num_heads, num_kv_heads = 2, 1
    gen = torch.Generator().manual_seed(3)
    positions = torch.tensor([1, 6, 11], device=device())
    cos, sin = _cos_sin(ROPES["yarn-mscale"], positions, torch.float32)
    qk = torch.randn(3, num_heads + num_kv_heads, HEAD_DIM, generator=gen).to(device())
    value = torch.randn(3, num_kv_heads, HEAD_DIM, generator=gen).to(device())
    kv_cache = torch.zeros(2, 2, 8, num_kv_heads, HEAD_DIM, dtype=torch.float16, device=device())
    slot_mapping = torch.tensor([0, 9, 15], dtype=torch.int64, device=device())
    expected_qk, expected_cache = ref_rotary_cos_sin(qk, cos, sin), kv_cache.clone()
    ref_write_kv_cache(
        expected_qk[:, num_heads:].half(), value.half(), expected_cache, slot_mapping
    )

    rotary_write_kv_cache(qk, value, cos, sin, kv_cache, slot_mapping, num_heads)

    torch.testing.assert_close(qk, expected_qk, **TOLERANCES[torch.float32])
    torch.testing.assert_close(kv_cache, expected_cache, atol=0, rtol=0)


def test_launcher_rejects_a_cos_sin_of_another_shape() -> None:
    qk = torch.zeros(4, 3, HEAD_DIM, device=device())
    cos = sin = torch.zeros(4, HEAD_DIM, device=device())  # the table's [T, D], not [T, 1, D]
    with pytest.raises(ValueError, match="cos must be"):
        rotary_cos_sin_(qk, cos, sin)
    kv_cache = torch.zeros(2, 1, 4, 2, HEAD_DIM, device=device())
    good = torch.zeros(4, 1, HEAD_DIM, device=device())
    with pytest.raises(ValueError, match="kv_cache holds"):  # 2 query heads leave 1 key head
        rotary_write_kv_cache(
            qk, qk[:, :2], good, good, kv_cache, torch.zeros(4, dtype=torch.int64), 2
        )


@pytest.mark.parametrize("name", ["default", "llama3", "yarn-mscale", "longrope"])
def test_triton_rotary_gathers_the_same_cos_sin(name: str) -> None:
    """The Triton op path gathers (c | c), (-s | s) from one table per dtype in one kernel; the
    values are those the torch path builds per forward, bit for bit (longrope, length
    dependent, still builds them per forward)."""
    positions = torch.tensor([0, 5, 16, 63, 5], device=device())
    lengths = positions + 2 * MAX_POS
    for dtype in (torch.float32, torch.float16):
        want = RotaryEmbedding(HEAD_DIM, MAX_POS, 10000.0, ROPES[name], "torch").cos_sin(
            positions, dtype, lengths
        )
        got = RotaryEmbedding(HEAD_DIM, MAX_POS, 10000.0, ROPES[name], "triton").cos_sin(
            positions, dtype, lengths
        )
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape == (5, 1, HEAD_DIM) and g.stride(-1) == 1
            torch.testing.assert_close(g, w, atol=0, rtol=0)
