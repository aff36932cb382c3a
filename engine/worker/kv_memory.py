"""KV-cache memory on the CPU: zeroed, and resident only once a block is first written.

`torch.zeros` of a 4 GiB cache writes every page at start-up, so an idle engine holds the
whole budget resident. An anonymous private mapping is zero-filled by the kernel and backed
page by page on first touch: the cache keeps its zero-initialisation guarantee (the attention
kernels mask unused slots by weight 0, and 0 * NaN from uninitialised memory would poison the
sum) while the resident size follows the blocks actually used. Unmapped when the tensor is
freed (the tensor holds the only reference to the mapping).
"""

from __future__ import annotations

import math
import mmap

import torch


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of zeros whose pages are mapped on first use."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps `mapping` alive for the tensor's lifetime and shares its memory.
    return torch.frombuffer(mapping, dtype=dtype, count=numel).view(shape)
