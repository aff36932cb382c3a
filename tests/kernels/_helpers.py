"""Shared pieces of the kernel tests: device-dependent sizes, tolerances, batch builders.

Without CUDA the kernels run in the Triton interpreter, so shapes stay small; with CUDA the
same tests run at full size.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch


def full_size() -> bool:
    """True on a CUDA machine: tests use realistic shapes instead of interpreter-sized ones."""
    return torch.cuda.is_available()


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def pick(small, large):
    """`small` in the interpreter, `large` on a GPU."""
    return large if full_size() else small


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# bf16 is GPU-only: the interpreter mis-rounds bf16 (tl.dot and conversions).
DTYPES = [
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16", marks=requires_cuda),
]

# Tolerances against fp32 references: about two units in the last place of the output dtype.
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


def free_gpu_bytes() -> int:
    if not torch.cuda.is_available():
        return 0
    free, _ = torch.cuda.mem_get_info()
    return free


@dataclass
class PagedBatch:
    """Inputs of one paged-attention call, built as the engine would build them."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    max_query_len: int
    max_seq_len: int


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_blocks: int | None = None,
    seed: int = 0,
) -> PagedBatch:
    """A random cache whose blocks are handed out in shuffled order (block tables are not
    contiguous ranges), padded with 0 past each request's last block."""
    assert all(1 <= q <= s for q, s in zip(query_lens, seq_lens))
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    needed = sum(blocks_per_req)
    num_blocks = num_blocks if num_blocks is not None else needed + 3
    assert num_blocks >= needed
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=gen).to(dtype)
    shuffled = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros((len(seq_lens), max(blocks_per_req)), dtype=torch.int32)
    used = 0
    for req, count in enumerate(blocks_per_req):
        block_tables[req, :count] = shuffled[used : used + count]
        used += count
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    query = torch.randn((starts[-1], num_heads, head_dim), generator=gen).to(dtype)
    dev = device()
    return PagedBatch(
        query=query.to(dev),
        kv_cache=kv_cache.to(dev),
        block_tables=block_tables.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def mixed_batch_lens() -> tuple[list[int], list[int]]:
    """Decodes first (1 token), then prefill chunks: a first chunk that fills a whole chunk,
    a later chunk after cached tokens, a few tokens; contexts end mid-block."""
    if full_size():
        decode_seq = [1, 17, 300, 1000, 2049, 4095]
        return [1] * len(decode_seq) + [512, 77, 3], [*decode_seq, 512, 1100, 35]
    return [1, 1, 1, 1, 24, 7, 3], [1, 17, 33, 70, 24, 45, 19]
