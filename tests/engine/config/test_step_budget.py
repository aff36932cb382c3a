"""The default token budget of a step: short steps on the CPU (max_num_seqs, so a decode
batch fits), 2048 on a GPU, whole prompts without chunked prefill; an explicit value wins."""

from __future__ import annotations

import pytest

from engine import LLM, EngineArgs
from engine.config.step_budget import default_max_num_batched_tokens
from tests.model_utils import make_tiny_llama


def test_the_cpu_budget_is_the_decode_batch() -> None:
    assert default_max_num_batched_tokens("cpu", 256, True, 4096) == 256
    assert default_max_num_batched_tokens("cpu", 512, True, 4096) == 512
    assert default_max_num_batched_tokens("cpu", 8, True, 4096) == 256  # at least 256
    assert default_max_num_batched_tokens("cpu", 10_000, True, 4096) == 2048  # at most


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_gpu_keeps_2048(device: str) -> None:
    assert default_max_num_batched_tokens(device, 256, True, 4096) == 2048


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_without_chunked_prefill_a_whole_prompt_fits(device: str) -> None:
    assert default_max_num_batched_tokens(device, 256, False, 8192) == 8192
    assert default_max_num_batched_tokens(device, 256, False, 512) == 2048


def test_engine_args_apply_it(tmp_path) -> None:
    model = str(make_tiny_llama(tmp_path / "tiny", max_position_embeddings=128))
    sched = EngineArgs(model=model, device="cpu").create_engine_config().scheduler_config
    assert sched.max_num_batched_tokens == 256
    sched = EngineArgs(model=model, max_num_seqs=300).create_engine_config().scheduler_config
    assert sched.max_num_batched_tokens == 300
    given = EngineArgs(model=model, max_num_batched_tokens=1000).create_engine_config()
    assert given.scheduler_config.max_num_batched_tokens == 1000


def test_the_offline_llm_keeps_2048(tmp_path) -> None:
    """Offline batch work wants throughput: `LLM` keeps 2048 unless told otherwise."""
    model = str(make_tiny_llama(tmp_path / "tiny", max_position_embeddings=128))
    llm = LLM(model, device="cpu", kv_cache_memory_bytes=1 << 22)
    assert llm.llm_engine.get_scheduler_config().max_num_batched_tokens == 2048
    llm = LLM(model, device="cpu", kv_cache_memory_bytes=1 << 22, max_num_batched_tokens=64)
    assert llm.llm_engine.get_scheduler_config().max_num_batched_tokens == 64
