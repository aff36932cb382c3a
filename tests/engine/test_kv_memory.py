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


def test_lazily_zeroed_is_zero_and_resident_only_where_written() -> None:
    shape = (2, 4096, 16, 4, 64)  # 128 MiB of fp32
    before = _rss()
    cache = lazily_zeroed(shape, torch.float32)
    assert cache.shape == shape and cache.dtype == torch.float32 and cache.is_contiguous()
    assert _rss() - before < 16 * MiB  # nothing touched yet
    assert not cache[0, :64].any() and not cache[1, -64:].any()
    cache[0, :256].fill_(1.5)  # 4 MiB of blocks written
    grown = _rss() - before
    assert 4 * MiB <= grown < 24 * MiB
    assert cache[0, :256].eq(1.5).all() and not cache[0, 256:300].any()
    del cache
    gc.collect()
    assert _rss() - before < 16 * MiB  # unmapped with the tensor


def test_engine_kv_cache_is_not_resident_at_start(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "tiny", hidden_size=64, num_layers=2, num_heads=4)
    num_blocks = 8192  # 2 layers x [2, 8192, 16, 2 KV heads, 16] fp32 = 64 MiB in all
    before = _rss()
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(model_dir), num_gpu_blocks_override=num_blocks, max_num_seqs=4)
    )
    kv_bytes = sum(c.numel() * c.element_size() for c in engine.runner.kv_caches)
    assert kv_bytes >= 64 * MiB
    assert _rss() - before < kv_bytes // 2
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    assert _rss() - before < kv_bytes // 2
