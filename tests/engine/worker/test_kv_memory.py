"""The CPU KV cache is zeroed but resident only where blocks have been written."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
import torch

from engine import EngineArgs, LLMEngine, SamplingParams
from engine.worker.kv_memory import lazily_zeroed
from tests.model_utils import make_tiny_llama

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads the resident size from /proc"
)

MiB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _mapping(address: int) -> tuple[int, int] | None:
    """(start, resident bytes) of this process's mapping holding `address`, from smaps:
    the mapping's own pages, whatever else the process allocates or frees meanwhile."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                found = start if start <= address < end else None
            elif found is not None and line.startswith("Rss:"):
                return found, int(line.split()[1]) * 1024
    return None


def test_lazily_zeroed_is_zero_and_resident_only_where_written() -> None:
    shape = (2, 4096, 16, 4, 64)  # 128 MiB of fp32
    cache = lazily_zeroed(shape, torch.float32)
    assert cache.shape == shape and cache.dtype == torch.float32 and cache.is_contiguous()
    address = cache.data_ptr()
    start, resident = _mapping(address)
    assert start == address  # a mapping of its own
    assert resident == 0  # nothing touched yet
    assert not cache[0, :64].any() and not cache[1, -64:].any()
    assert _mapping(address)[1] <= 4 * MiB  # reads map the zero page, if anything
    cache[0, :256].fill_(1.5)  # 4 MiB of blocks written
    # those pages, give or take huge pages at the edges: not the 128 MiB of the whole cache
    assert 4 * MiB <= _mapping(address)[1] < 16 * MiB
    assert cache[0, :256].eq(1.5).all() and not cache[0, 256:300].any()
    del cache
    gc.collect()
    found = _mapping(address)
    assert found is None or found[0] != start  # unmapped with the tensor


def test_engine_kv_cache_is_not_resident_at_start(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "tiny", hidden_size=64, num_layers=2, num_heads=4)
    num_blocks = 8192  # 2 layers x [2, 8192, 16, 2 KV heads, 16] fp32 = 64 MiB in all
    before = _rss()
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(model_dir),
            dtype="float32",  # the resident bytes below are an fp32 cache's
            num_gpu_blocks_override=num_blocks,
            max_num_seqs=4,
        )
    )
    kv_bytes = sum(c.numel() * c.element_size() for c in engine.runner.kv_caches)
    assert kv_bytes >= 64 * MiB
    assert _rss() - before < kv_bytes // 2
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    assert _rss() - before < kv_bytes // 2
