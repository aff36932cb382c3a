"""vLLM's remaining engine API: config getters, the virtual-engine query, and on
`AsyncLLMEngine` the async getters, `reset_prefix_cache`, `engine_step()` by hand,
a restartable background loop, `is_stopped` / `errored`, `get_input_preprocessor` and
`log_requests`. Each test follows one usage example of vLLM's API docs.

Plain test functions that drive their coroutine with `asyncio.run` (no pytest plugin)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from engine import AsyncLLMEngine, EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from engine.config.parallel import ParallelConfig
from engine.structured_output import DecodingConfig
from engine.structured_output.backend import BACKEND_NAME
from tests.model_utils import make_tiny_llama

PROMPT = {"prompt_token_ids": [5, 17, 9, 33, 4, 61, 12]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-api"), max_position_embeddings=128)


def engine_args(model_dir, **kwargs) -> EngineArgs:
    return EngineArgs(
        model=str(model_dir),
        max_model_len=128,
        max_num_seqs=8,
        kv_cache_memory_bytes=1 << 22,
        **kwargs,
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


@pytest.fixture(scope="module")
def reference_tokens(model_dir) -> list[int]:
    """The greedy tokens of PROMPT, from the synchronous engine."""
    engine = LLMEngine.from_engine_args(engine_args(model_dir))
    engine.add_request("ref", PROMPT, greedy(12))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    return list(outputs[0].outputs[0].token_ids)


@contextlib.contextmanager
def async_engine(model_dir, **kwargs):
    engine = AsyncLLMEngine(LLMEngine.from_engine_args(engine_args(model_dir)), **kwargs)
    try:
        yield engine
    finally:
        engine.shutdown()


async def final_tokens(engine: AsyncLLMEngine, request_id: str, max_tokens: int = 12):
    final = None
    async for output in engine.generate(PROMPT, greedy(max_tokens), request_id):
        final = output
    assert final is not None and final.finished
    return list(final.outputs[0].token_ids)


# ---- LLMEngine ------------------------------------------------------------------------------


def test_config_getters(model_dir) -> None:
    """`engine.get_decoding_config()`, `get_parallel_config()`, `get_lora_config()`."""
    engine = LLMEngine.from_engine_args(engine_args(model_dir))
    decoding = engine.get_decoding_config()
    assert isinstance(decoding, DecodingConfig) and decoding.backend == BACKEND_NAME
    parallel = engine.get_parallel_config()
    assert isinstance(parallel, ParallelConfig)
    assert parallel.tensor_parallel_size == parallel.pipeline_parallel_size == 1
    assert parallel.world_size == 1
    assert engine.get_lora_config() is None
    assert engine.get_engine_config().parallel_config is parallel
    processor = engine.get_input_preprocessor()
    text, token_ids = processor.process(PROMPT, greedy(1))
    assert text is None and token_ids == PROMPT["prompt_token_ids"]
    with pytest.raises(ValueError, match="prompt_token_ids must not be empty"):
        processor.process({"prompt_token_ids": []}, greedy(1))


def test_has_unfinished_requests_for_virtual_engine(model_dir) -> None:
    """vLLM's step loop: `while engine.has_unfinished_requests_for_virtual_engine(0)`."""
    engine = LLMEngine.from_engine_args(engine_args(model_dir))
    assert engine.has_unfinished_requests_for_virtual_engine(0) is False
    engine.add_request("a", PROMPT, greedy(3))
    assert engine.has_unfinished_requests_for_virtual_engine(0) is True
    num_steps = 0
    while engine.has_unfinished_requests_for_virtual_engine(0):
        engine.step()
        num_steps += 1
    assert num_steps >= 3
    with pytest.raises(ValueError, match="virtual_engine"):
        engine.has_unfinished_requests_for_virtual_engine(1)


# ---- AsyncLLMEngine -------------------------------------------------------------------------


def test_async_getters_and_input_preprocessor(model_dir) -> None:
    async def main() -> None:
        with async_engine(model_dir) as engine:
            assert (await engine.get_decoding_config()).backend == BACKEND_NAME
            assert (await engine.get_parallel_config()).world_size == 1
            assert await engine.get_lora_config() is None
            assert (await engine.get_cache_config()).num_blocks > 0
            assert (await engine.get_scheduler_config()).max_num_seqs == 8
            assert (await engine.get_device_config()).device == "cpu"
            assert (await engine.get_model_config()).max_model_len == 128
            processor = await engine.get_input_preprocessor()
            assert processor.process(PROMPT, greedy(1))[1] == PROMPT["prompt_token_ids"]

    asyncio.run(main())


def test_engine_step_by_hand(model_dir, reference_tokens) -> None:
    """vLLM's loop without the background task: `while await engine.engine_step(0)`."""

    async def main() -> None:
        with async_engine(model_dir, start_engine_loop=False) as engine:
            assert not engine.is_running and not engine.errored and not engine.is_stopped
            task = asyncio.create_task(final_tokens(engine, "by-hand"))
            await asyncio.sleep(0)  # the generator submits its request
            num_steps = 0
            while await engine.engine_step(0):
                num_steps += 1
            assert await task == reference_tokens
            assert num_steps >= len(reference_tokens) - 1
            assert await engine.engine_step() is False  # nothing left: a no-op step
            with pytest.raises(ValueError, match="virtual_engine"):
                await engine.engine_step(1)
            engine.start_background_loop()
            assert engine.is_running
            with pytest.raises(RuntimeError, match="shutdown_background_loop"):
                await engine.engine_step()
            assert await final_tokens(engine, "looped") == reference_tokens

    asyncio.run(main())


def test_background_loop_restarts_and_keeps_requests(model_dir, reference_tokens) -> None:
    """`shutdown_background_loop()` then `start_background_loop()`: a request in flight
    survives the pause, requests sent meanwhile wait, and the results are unchanged."""

    async def main() -> None:
        with async_engine(model_dir) as engine:
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            stream = engine.generate(PROMPT, params, "survivor")
            tokens = list((await anext(stream)).outputs[0].token_ids)
            engine.shutdown_background_loop()
            assert not engine.is_running
            assert not engine.errored and not engine.is_stopped
            await engine.check_health()  # a paused loop is healthy
            waiting = asyncio.create_task(final_tokens(engine, "sent-while-paused"))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            engine.start_background_loop()
            with pytest.raises(RuntimeError, match="already running"):
                engine.start_background_loop()
            async for output in stream:
                tokens = list(output.outputs[0].token_ids)
            assert tokens == reference_tokens
            assert await waiting == reference_tokens
            await engine.wait_until_idle(timeout=60)
            stats = engine.get_stats()
            assert stats.num_free_blocks == stats.num_total_blocks
        assert engine.is_stopped and engine.errored and not engine.is_running

    asyncio.run(main())


def test_reset_prefix_cache(model_dir) -> None:
    """`await engine.reset_prefix_cache()` empties the prefix cache between requests."""
    prompt = {"prompt_token_ids": list(range(3, 3 + 40))}

    async def cached_tokens(engine: AsyncLLMEngine, request_id: str) -> int:
        final = None
        async for output in engine.generate(prompt, greedy(2), request_id):
            final = output
        assert final is not None
        return final.num_cached_tokens or 0

    async def main() -> None:
        with async_engine(model_dir) as engine:
            assert await cached_tokens(engine, "first") == 0
            assert await cached_tokens(engine, "second") >= 32  # two full blocks hit
            await engine.wait_until_idle(timeout=60)
            assert await engine.reset_prefix_cache() is True
            assert await cached_tokens(engine, "third") == 0
        # With the loop off the call runs on the caller's thread, between steps.
        with async_engine(model_dir, start_engine_loop=False) as engine:
            assert await engine.reset_prefix_cache() is True

    asyncio.run(main())


def test_log_requests(model_dir, caplog) -> None:
    """`AsyncLLMEngine(..., log_requests=True)`: one line per request added / finished."""

    async def run(engine: AsyncLLMEngine, request_id: str) -> None:
        try:
            await final_tokens(engine, request_id, max_tokens=3)
        finally:
            engine.shutdown()

    with caplog.at_level(logging.INFO, logger="engine.front.engine_thread"):
        args = engine_args(model_dir, enable_log_requests=True)
        asyncio.run(run(AsyncLLMEngine.from_engine_args(args), "logged"))
        asyncio.run(run(AsyncLLMEngine.from_engine_args(engine_args(model_dir)), "quiet"))
    messages = [r.getMessage() for r in caplog.records if r.name == "engine.front.engine_thread"]
    assert messages.count("Added request logged.") == 1
    assert messages.count("Finished request logged.") == 1
    assert not [m for m in messages if "quiet" in m]
