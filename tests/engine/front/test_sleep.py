"""Sleep mode (vLLM's `sleep(level)` / `wake_up(tags)` / `is_sleeping()`): the memory given
back is measured (process RSS on CPU), wake-up gives the same greedy tokens, requests sent
while asleep wait for wake-up, and health stays good."""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest
import torch

from engine import LLM, AsyncLLMEngine, EngineArgs, SamplingParams

MAX_TOKENS = 10
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [
    {"prompt_token_ids": list(range(3, 43))},  # two and a half blocks: prefix-cacheable
    {"prompt_token_ids": [7, 300, 41, 5000, 12]},
]
# 64 MiB of KV cache (2 layers x 32 MiB) and ~25 MB of fp32 weights: both far above the
# RSS noise of one process.
KV_BYTES = 64 << 20
ENGINE_KWARGS = dict(max_model_len=128, max_num_seqs=256, kv_cache_memory_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.model_utils import make_tiny_llama

    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny-sleep"),
        hidden_size=256,
        intermediate_size=1024,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=8192,
        max_position_embeddings=128,
    )


def rss() -> int:
    return psutil.Process().memory_info().rss


def _touch_every_page(caches: list[torch.Tensor]) -> None:
    for cache in caches:  # (a loop in the test would keep the last cache referenced)
        cache.fill_(0)


def tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_sleep_levels_give_memory_back_and_wake_up_gives_the_same_tokens(model_dir):
    """vLLM's example: `llm.sleep(level=1)` ... `llm.wake_up()` ... `llm.generate(...)`.
    Measured by the process's RSS, so on the CPU whatever device the machine has (the CUDA
    engine's device memory: test_cuda_sleep_gives_device_memory_back)."""
    # fp32: the byte counts below are fp32's ("auto" is bf16 where bf16 is native)
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", **ENGINE_KWARGS)
    engine = llm.llm_engine
    runner = engine.runner
    kv_bytes = runner.num_blocks * runner.kv_bytes_per_block
    assert kv_bytes >= 60 << 20
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    reference = tokens(llm)
    assert tokens(llm) == reference  # a prefix-cache hit changes nothing

    # The CPU cache is mapped lazily (resident only where blocks were written): write every
    # page, so that what sleep gives back is the whole cache whatever ran before.
    _touch_every_page(runner.kv_caches)
    awake = rss()
    llm.sleep(level=1)
    assert engine.is_sleeping()
    freed = awake - rss()
    assert freed >= 0.8 * kv_bytes, f"level 1 gave back {freed} B of {kv_bytes} B of KV cache"
    with pytest.raises(RuntimeError, match="wake_up"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.wake_up()
    assert not engine.is_sleeping()
    # The cache came back empty and the prefix cache was reset: no stale hit.
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [0, 0]
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference

    _touch_every_page(runner.kv_caches)
    awake = rss()
    llm.sleep(level=2)
    freed = awake - rss()
    expected = kv_bytes + weight_bytes
    assert freed >= 0.8 * expected, f"level 2 gave back {freed} B of {expected} B"
    assert runner.model is None
    llm.wake_up(tags=["weights"])  # weights reloaded from the files first
    assert engine.is_sleeping() and runner.model is not None and runner.kv_caches == []
    llm.wake_up(tags=["kv_cache"])
    assert not engine.is_sleeping()
    assert tokens(llm) == reference


def test_sleep_checks_its_arguments_and_an_idle_engine(model_dir):
    llm = LLM(model=str(model_dir), **ENGINE_KWARGS)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(level=3)
    engine.add_request("busy", PROMPTS[1], PARAMS)
    with pytest.raises(RuntimeError, match="1 requests are unfinished"):
        engine.sleep(1)
    assert not engine.is_sleeping()
    engine.abort_request("busy")
    engine.step()
    engine.sleep(1)
    with pytest.raises(RuntimeError, match="already asleep"):
        engine.sleep(2)
    with pytest.raises(ValueError, match="tags has unknown entries"):
        engine.wake_up(["weights", "kv"])
    assert engine.is_sleeping()
    engine.wake_up(["weights"])  # not asleep on CPU at level 1: nothing to do
    assert engine.is_sleeping()
    engine.wake_up()
    assert not engine.is_sleeping()
    engine.wake_up()  # awake already: a no-op


def test_async_requests_sent_while_asleep_wait_for_wake_up(model_dir):
    reference = tokens(LLM(model=str(model_dir), **ENGINE_KWARGS))

    async def generate(engine: AsyncLLMEngine, prompt: dict, request_id: str) -> list[int]:
        final = None
        async for output in engine.generate(prompt, PARAMS, request_id):
            final = output
        assert final is not None and final.finished
        return list(final.outputs[0].token_ids)

    async def main() -> None:
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(model_dir), **ENGINE_KWARGS))
        try:
            await engine.sleep(level=2)
            assert await engine.is_sleeping()
            tasks = [
                asyncio.create_task(generate(engine, p, f"sent-asleep-{i}"))
                for i, p in enumerate(PROMPTS)
            ]
            # Every request has reached the engine and is held waiting, however slowly the
            # loaded machine delivers them; none has run.
            deadline = time.monotonic() + 60
            while engine.get_stats().num_waiting < len(PROMPTS):
                assert time.monotonic() < deadline, engine.get_stats()
                await asyncio.sleep(0.02)
            assert not any(t.done() for t in tasks), "a request ran on a sleeping engine"
            await engine.check_health()  # asleep is healthy
            stats = engine.get_stats()
            assert stats.is_sleeping and stats.num_waiting == len(PROMPTS)
            await engine.wake_up()
            assert not await engine.is_sleeping()
            assert [await t for t in tasks] == reference
            await engine.wait_until_idle(timeout=60)
        finally:
            engine.shutdown()

    asyncio.run(main())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sleep_gives_device_memory_back(model_dir):
    """On CUDA, level 1 moves the weights to host memory and level 2 frees them: the
    allocated device memory drops by the cache and the weights either way."""
    llm = LLM(model=str(model_dir), device="cuda", dtype="float32", **ENGINE_KWARGS)
    runner = llm.llm_engine.runner
    kv_bytes = runner.num_blocks * runner.kv_bytes_per_block
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    reference = tokens(llm)
    for level in (1, 2):
        torch.cuda.synchronize()
        awake = torch.cuda.memory_allocated()
        llm.sleep(level=level)
        freed = awake - torch.cuda.memory_allocated()
        assert freed >= 0.95 * (kv_bytes + weight_bytes), (level, freed)
        llm.wake_up()
        assert tokens(llm) == reference


def test_sleep_mode_example(model_dir):
    """vLLM's sleep-mode docs, as written but for the model: `LLM(model,
    enable_sleep_mode=True)`, `sleep(level=1)` then `wake_up()`; `sleep(level=2)` then
    `wake_up(tags=["weights"])` and `wake_up(tags=["kv_cache"])` (vLLM reloads the weights
    with `collective_rpc("reload_weights")` in between; here level 2's wake-up reloads them
    from the model files itself). The answer after each wake-up is the one before."""
    llm = LLM(model=str(model_dir), enable_sleep_mode=True, **ENGINE_KWARGS)
    output = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.sleep(level=1)
    llm.wake_up()
    output2 = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    assert llm.llm_engine.is_sleeping()  # the KV cache is still asleep
    llm.wake_up(tags=["kv_cache"])
    assert not llm.llm_engine.is_sleeping()
    output3 = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in output]
    assert [o.outputs[0].token_ids for o in output2] == expected
    assert [o.outputs[0].token_ids for o in output3] == expected
