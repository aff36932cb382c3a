"""KV-cache write kernel vs. the torch reference: slots, padding, strided inputs."""

from __future__ import annotations

import pytest
import torch

from kernels import ref_write_kv_cache, write_kv_cache
from tests.kernels._helpers import DTYPES, device, free_gpu_bytes, pick, requires_cuda


def _random_slots(num_tokens: int, num_slots: int, num_padding: int, seed: int) -> torch.Tensor:
    """Distinct slots in random order, with `num_padding` of them replaced by -1."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:num_padding]] = -1
    return slots.to(device())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (2, 128), (3, 96)])
def test_write_matches_reference(
    dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int
) -> None:
    num_blocks = pick(6, 2048)
    num_tokens = pick(37, 3000)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, device=device()).to(dtype)
    expected = kv_cache.clone()
    # Keys/values as slices of one fused projection output: token stride != heads * dim.
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, device=device()).to(dtype)
    key, value = fused[:, 1], fused[:, 2]
    slots = _random_slots(num_tokens, num_blocks * block_size, num_padding=5, seed=block_size)

    write_kv_cache(key, value, kv_cache, slots)
    ref_write_kv_cache(key, value, expected, slots)

    # A copy: bit-exact, and slots not named (padding or unused) keep their old contents.
    torch.testing.assert_close(kv_cache, expected, atol=0, rtol=0)
    written = kv_cache.view(2, -1, num_kv_heads, head_dim)[:, slots[slots >= 0]]
    torch.testing.assert_close(written[0], key[slots >= 0], atol=0, rtol=0)
    torch.testing.assert_close(written[1], value[slots >= 0], atol=0, rtol=0)


def test_all_padding_changes_nothing() -> None:
    kv_cache = torch.randn(2, 4, 16, 2, 32, device=device())
    before = kv_cache.clone()
    key = torch.randn(3, 2, 32, device=device())
    slots = torch.full((3,), -1, dtype=torch.int64, device=device())
    write_kv_cache(key, key, kv_cache, slots)
    torch.testing.assert_close(kv_cache, before, atol=0, rtol=0)


@requires_cuda
def test_slots_beyond_int32_offsets() -> None:
    """Slots whose element offset exceeds 2^31 must land in the right place."""
    block_size, num_kv_heads, head_dim, dtype = 16, 1, 64, torch.float16
    block_stride = block_size * num_kv_heads * head_dim
    num_blocks = (2**31) // block_stride + 64
    cache_bytes = 2 * num_blocks * block_stride * dtype.itemsize
    if free_gpu_bytes() < cache_bytes + (2 << 30):
        pytest.skip(f"needs {cache_bytes / 2**30:.1f} GiB of free GPU memory")
    kv_cache = torch.zeros(
        (2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device()
    )
    num_slots = num_blocks * block_size
    slots = torch.tensor([num_slots - 1, 5, -1, num_slots - 40], device=device())
    key = torch.randn(4, num_kv_heads, head_dim, dtype=dtype, device=device())
    value = torch.randn_like(key)
    write_kv_cache(key, value, kv_cache, slots)
    flat = kv_cache.view(2, num_slots, num_kv_heads, head_dim)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(flat[0, slot], key[token], atol=0, rtol=0)
            torch.testing.assert_close(flat[1, slot], value[token], atol=0, rtol=0)
    for untouched in (num_slots - 2, num_slots - 39, 4):  # neighbours stay zero
        assert not flat[:, untouched].any()
    del kv_cache, flat
    torch.cuda.empty_cache()
