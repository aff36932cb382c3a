"""AsyncLLMEngine: streaming, concurrency, cancellation and aborts freeing KV blocks, error
propagation, a responsive event loop, engine death and shutdown, and async pooling.

Plain test functions that drive their coroutine with `asyncio.run` (no pytest plugin)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import threading
import time

import pytest
import torch

from engine import (
    LLM,
    AsyncLLMEngine,
    EngineArgs,
    EngineDeadError,
    LLMEngine,
    PoolingParams,
    PoolingRequestOutput,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from tests.model_utils import make_tiny_llama

VOCAB = 128
DELTA = RequestOutputKind.DELTA


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-async"), max_position_embeddings=256)


def engine_args(model_dir, **kwargs) -> EngineArgs:
    # fp32: a request's tokens alone and in a concurrent batch are equal in fp32 only
    # ("auto" is bf16 on CPUs where bf16 is native)
    kwargs = {"dtype": "float32", **kwargs}
    return EngineArgs(model=str(model_dir), max_model_len=256, max_num_seqs=64, **kwargs)


@contextlib.contextmanager
def async_engine(model_dir, **kwargs):
    engine = AsyncLLMEngine.from_engine_args(engine_args(model_dir, **kwargs))
    try:
        yield engine
    finally:
        engine.shutdown()


def greedy(max_tokens: int, kind: RequestOutputKind = DELTA) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)


def ids(prompt: list[int]) -> dict:
    return {"prompt_token_ids": prompt}


def random_prompts(num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 40))] for _ in range(num)]


async def collect(engine: AsyncLLMEngine, prompt, params, request_id: str) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, request_id)]


def joined_tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.outputs[0].token_ids]


async def assert_idle_and_free(engine: AsyncLLMEngine, max_generated: int | None = None) -> None:
    await engine.wait_until_idle(timeout=60)
    stats = engine.get_stats()
    assert engine.num_running() == engine.num_waiting() == 0
    assert stats.num_requests == 0
    assert stats.num_free_blocks == stats.num_total_blocks, "KV blocks leaked"
    if max_generated is not None:  # the requests were cut short, not run to the end
        assert stats.num_generation_tokens_total <= max_generated


# ---- streaming ---------------------------------------------------------------------------


def test_generate_streams_deltas_equal_to_llm_generate(model_dir) -> None:
    prompt = random_prompts(1)[0]
    (reference,) = LLM(**vars(engine_args(model_dir))).generate(
        [ids(prompt)], greedy(16, RequestOutputKind.FINAL_ONLY), use_tqdm=False
    )

    async def main() -> None:
        with async_engine(model_dir) as engine:
            outputs = await collect(engine, ids(prompt), greedy(16), "r0")
            # One delta per step while the consumer keeps up; a consumer behind (a loaded
            # machine) gets what queued merged into one (output_merge.py): never an empty
            # delta, never more outputs than tokens.
            assert 1 <= len(outputs) <= 16
            assert all(len(o.outputs[0].token_ids) >= 1 for o in outputs)
            assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
            assert outputs[-1].outputs[0].finish_reason == "length"
            assert joined_tokens(outputs) == reference.outputs[0].token_ids
            # A finished request's id can be used again.
            again = await collect(engine, ids(prompt), greedy(4), "r0")
            assert joined_tokens(again) == reference.outputs[0].token_ids[:4]
            await assert_idle_and_free(engine)
            assert engine.get_stats().num_generation_tokens_total == 20

    asyncio.run(main())


def test_many_concurrent_generators(model_dir) -> None:
    prompts = random_prompts(32, seed=1)
    reference = LLM(**vars(engine_args(model_dir))).generate(
        [ids(p) for p in prompts], greedy(10, RequestOutputKind.FINAL_ONLY), use_tqdm=False
    )

    async def main() -> None:
        with async_engine(model_dir, max_num_batched_tokens=64) as engine:
            results = await asyncio.gather(
                *(collect(engine, ids(p), greedy(10), f"c{i}") for i, p in enumerate(prompts))
            )
            for outputs, ref in zip(results, reference):
                assert outputs[-1].finished
                assert joined_tokens(outputs) == ref.outputs[0].token_ids
            await assert_idle_and_free(engine)

    asyncio.run(main())


# ---- the consumer goes away; abort ------------------------------------------------------------


def test_closing_the_generator_aborts_the_request(model_dir) -> None:
    async def main() -> None:
        with async_engine(model_dir) as engine:
            gen = engine.generate(ids([5, 6, 7]), greedy(200), "closed")
            received = 0
            async for _ in gen:
                received += 1
                if received == 2:
                    break
            await gen.aclose()
            await assert_idle_and_free(engine, max_generated=50)

            # Dropping the generator without aclose(): asyncio finalises it, same effect.
            async def consume_one() -> None:
                async for _ in engine.generate(ids([5, 6, 7]), greedy(200), "dropped"):
                    return

            await consume_one()
            await assert_idle_and_free(engine, max_generated=100)

    asyncio.run(main())


def test_cancelling_the_consumer_task_aborts_the_request(model_dir) -> None:
    async def main() -> None:
        with async_engine(model_dir) as engine:
            first = asyncio.Event()

            async def consume() -> None:
                async for _ in engine.generate(ids([9, 10, 11, 12]), greedy(200), "cancelled"):
                    first.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(first.wait(), timeout=10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await assert_idle_and_free(engine, max_generated=50)

    asyncio.run(main())


def test_abort_ends_the_generator_with_finish_reason_abort(model_dir) -> None:
    async def main() -> None:
        with async_engine(model_dir) as engine:
            outputs = []
            async for out in engine.generate(ids([3, 4, 5]), greedy(200), "to-abort"):
                outputs.append(out)
                if len(outputs) == 3:
                    await engine.abort("to-abort")
            final = outputs[-1]
            assert final.finished and final.outputs[0].finish_reason == "abort"
            assert all(not o.finished for o in outputs[:-1])
            await engine.abort(["unknown", "to-abort"])  # ignored
            await assert_idle_and_free(engine, max_generated=50)

    asyncio.run(main())


# ---- errors --------------------------------------------------------------------------------


def test_validation_errors_propagate_and_spare_other_requests(model_dir) -> None:
    sync_engine = LLMEngine.from_engine_args(engine_args(model_dir))
    bad_requests = [
        (ids([3, VOCAB + 1]), greedy(4), {}),
        (ids([]), greedy(4), {}),
        (ids([3]), SamplingParams(logprobs=1000), {}),
        (ids([3]), greedy(4), {"lora_request": object()}),
        (12345, greedy(4), {}),
        (ids([3]), greedy(4), {"priority": 3}),
    ]
    expected = []
    for prompt, params, kwargs in bad_requests:
        with pytest.raises(Exception) as info:
            sync_engine.add_request("x", prompt, params, **kwargs)
        expected.append((type(info.value), str(info.value)))
    assert {t for t, _ in expected} == {ValueError, TypeError}
    (reference,) = LLM(**vars(engine_args(model_dir))).generate(
        [ids([7, 8, 9])], greedy(30, RequestOutputKind.FINAL_ONLY), use_tqdm=False
    )

    async def main() -> None:
        with async_engine(model_dir) as engine:
            good = asyncio.create_task(collect(engine, ids([7, 8, 9]), greedy(30), "good"))
            await asyncio.sleep(0.01)
            for (prompt, params, kwargs), (exc_type, message) in zip(bad_requests, expected):
                with pytest.raises(exc_type) as info:
                    async for _ in engine.generate(prompt, params, "bad", **kwargs):
                        pass
                assert type(info.value) is exc_type and str(info.value) == message
            # An id in use: "held" is certainly running once its first token has come (240
            # tokens cannot all be decoded between that and the next call).
            held = engine.generate(ids([3]), greedy(240), "held")
            await held.__anext__()
            with pytest.raises(ValueError, match="already in use"):
                async for _ in engine.generate(ids([3]), greedy(4), "held"):
                    pass
            await engine.abort("held")
            await held.aclose()
            with pytest.raises(TypeError, match="SamplingParams"):
                async for _ in engine.generate(ids([3]), PoolingParams(), "wrong"):  # type: ignore[arg-type]
                    pass
            assert joined_tokens(await good) == reference.outputs[0].token_ids
            await engine.check_health()
            await assert_idle_and_free(engine)

    asyncio.run(main())


def test_a_failing_step_kills_the_engine(model_dir) -> None:
    async def main() -> None:
        with async_engine(model_dir) as engine:
            runner = engine.engine.runner
            real_execute = runner.launch  # what the executor calls per step
            calls = 0

            def flaky_execute(scheduler_output):
                nonlocal calls
                calls += 1
                if calls == 4:
                    raise RuntimeError("injected device failure")
                return real_execute(scheduler_output)

            runner.launch = flaky_execute
            tasks = [
                asyncio.create_task(collect(engine, ids([3 + i]), greedy(50), f"d{i}"))
                for i in range(3)
            ]
            for task in tasks:
                with pytest.raises(EngineDeadError, match="injected device failure") as info:
                    await task
                assert isinstance(info.value.__cause__, RuntimeError)
            assert engine.errored and not engine.is_running
            assert isinstance(engine.dead_error, EngineDeadError)
            with pytest.raises(EngineDeadError):
                await engine.check_health()
            with pytest.raises(EngineDeadError, match="injected"):
                await collect(engine, ids([3]), greedy(2), "after")
            with pytest.raises(EngineDeadError):
                async for _ in engine.encode(ids([3]), PoolingParams(), "after-pool"):
                    pass

    asyncio.run(main())


def test_shutdown_ends_in_flight_requests(model_dir) -> None:
    async def main() -> None:
        engine = AsyncLLMEngine.from_engine_args(engine_args(model_dir))
        assert engine.is_running and not engine.errored
        await engine.check_health()
        outputs = []
        async for out in engine.generate(ids([3, 4]), greedy(500), "long"):
            outputs.append(out)
            if len(outputs) == 2:
                engine.shutdown()
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        assert not engine.is_running and engine.errored
        with pytest.raises(EngineDeadError, match="shut down"):
            await collect(engine, ids([3]), greedy(2), "late")
        with pytest.raises(EngineDeadError):
            await engine.check_health()

    asyncio.run(main())


# ---- the event loop stays free ----------------------------------------------------------------


def test_event_loop_stays_responsive_during_a_step(model_dir) -> None:
    """A step runs on the engine thread, never on the event loop: each step here blocks
    until a ticker on the event loop has ticked five more times. Were the step run on the
    loop, no tick could come while it runs and the step would give up waiting (a minute),
    so the counts below would be 0. Ticks are counted per step, not timed."""
    ticks = [0]
    ticks_per_step: list[int] = []

    def ticking_execute(real_execute, scheduler_output):
        start = ticks[0]
        deadline = time.monotonic() + 60  # generous: only a stalled loop reaches it
        while ticks[0] - start < 5 and time.monotonic() < deadline:
            time.sleep(0.001)  # stands for a long forward pass, the GIL released
        ticks_per_step.append(ticks[0] - start)
        return real_execute(scheduler_output)

    async def main() -> None:
        with async_engine(model_dir) as engine:
            runner = engine.engine.runner
            runner.launch = functools.partial(ticking_execute, runner.launch)
            done = asyncio.Event()

            async def ticker() -> None:
                while not done.is_set():
                    await asyncio.sleep(0.001)
                    ticks[0] += 1

            tick_task = asyncio.create_task(ticker())
            outputs = await collect(engine, ids([3, 4, 5]), greedy(2), "slow")
            done.set()
            await tick_task
            assert outputs[-1].finished
            assert len(ticks_per_step) >= 2  # the prefill and a decode step
            assert min(ticks_per_step) >= 5, f"the event loop stalled in a step: {ticks_per_step}"

    asyncio.run(main())


# ---- pooling -----------------------------------------------------------------------------------


def test_encode_yields_one_pooling_output(model_dir) -> None:
    prompts = random_prompts(6, seed=2)
    reference = LLM(**vars(engine_args(model_dir))).encode(
        [ids(p) for p in prompts], use_tqdm=False
    )

    async def encode(engine, prompt, request_id) -> list[PoolingRequestOutput]:
        return [out async for out in engine.encode(ids(prompt), PoolingParams(), request_id)]

    async def main() -> None:
        with async_engine(model_dir, max_num_batched_tokens=16) as engine:
            generating = asyncio.create_task(collect(engine, ids([3, 4]), greedy(20), "gen"))
            results = await asyncio.gather(
                *(encode(engine, p, f"e{i}") for i, p in enumerate(prompts))
            )
            for outputs, ref in zip(results, reference):
                (output,) = outputs
                assert output.finished and output.num_cached_tokens == 0
                torch.testing.assert_close(output.outputs.data, ref.outputs.data)
            assert (await generating)[-1].finished
            with pytest.raises(TypeError, match="PoolingParams"):
                async for _ in engine.encode(ids([3]), greedy(2), "wrong"):  # type: ignore[arg-type]
                    pass

            # An aborted pooling request ends its generator without an output. It needs 13
            # steps of 16 tokens; the first is held until the abort is sent, so the abort
            # certainly comes first.
            runner = engine.engine.runner
            real_execute = runner.launch  # what the executor calls per step
            stepping, release = threading.Event(), threading.Event()

            def held_execute(scheduler_output):
                stepping.set()
                assert release.wait(timeout=120)
                return real_execute(scheduler_output)

            runner.launch = held_execute
            long_prompt = [3 + i % 100 for i in range(200)]
            gen = engine.encode(ids(long_prompt), PoolingParams(), "pool-abort")
            pending = asyncio.ensure_future(gen.__anext__())
            assert await asyncio.to_thread(stepping.wait, 120), "the request never ran"
            await engine.abort("pool-abort")
            release.set()
            with pytest.raises(StopAsyncIteration):
                await pending
            await assert_idle_and_free(engine)

    asyncio.run(main())


def test_an_aborted_request_id_serves_the_next_request_at_once(model_dir) -> None:
    """Abort a running request and ask again with its id straight away (a front whose client
    ended on a stop string): the new request is served, not refused as a live id, and the
    aborted one's stream ends with finish_reason "abort"; nothing leaks."""
    reference = LLM(**vars(engine_args(model_dir))).generate(
        [ids([5, 6, 7])], greedy(5, RequestOutputKind.FINAL_ONLY), use_tqdm=False
    )

    async def main() -> None:
        with async_engine(model_dir) as engine:
            for _ in range(5):
                held = engine.generate(ids([9, 10]), greedy(240), "reused")
                await held.__anext__()  # running
                await engine.abort("reused")
                again = await collect(engine, ids([5, 6, 7]), greedy(5), "reused")
                assert joined_tokens(again) == reference[0].outputs[0].token_ids
                last = [out async for out in held]
                assert last and last[-1].outputs[0].finish_reason == "abort"
            await assert_idle_and_free(engine)

    asyncio.run(main())
