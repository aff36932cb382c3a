"""AsyncLLMEngine.generate_into: each output handed to a callback in the engine thread's
hand-over of a step (no generator per request). The same outputs as `generate`; a request
finishing among many that go on; the caller cancelled, an abort, a failing callback and a
bad request: each ends only its own request and frees its KV blocks, and nothing is handed
over once the caller has gone."""

from __future__ import annotations

import asyncio

import pytest

from engine import RequestOutput, SamplingParams
from tests.engine.front.test_async_llm_engine import (
    DELTA,
    assert_idle_and_free,
    async_engine,
    collect,
    greedy,
    ids,
    joined_tokens,
    model_dir,  # noqa: F401  (the module's fixture)
    random_prompts,
)


async def gather_into(engine, prompt, params, request_id: str) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    await engine.generate_into(prompt, params, request_id, outputs.append)
    return outputs


def test_same_outputs_as_generate(model_dir) -> None:  # noqa: F811
    """Sampled with a seed and logprobs, n = 2: every output field the generator path
    gives, and one output per step (a callback is never behind). Each run has its own
    cache salt: no prefix-cache hit, so the same batches and the same bits."""
    prompt = random_prompts(1, seed=7)[0]
    params = SamplingParams(
        temperature=1.0, seed=5, n=2, logprobs=2, max_tokens=12, ignore_eos=True, output_kind=DELTA
    )

    async def main() -> None:
        with async_engine(model_dir) as engine:
            salted = {"prompt_token_ids": prompt, "cache_salt": "generate"}
            expected = await collect(engine, salted, params, "gen")
            salted = {"prompt_token_ids": prompt, "cache_salt": "generate_into"}
            got = await gather_into(engine, salted, params, "into")
            assert got[-1].finished and not any(o.finished for o in got[:-1])
            assert len(got) == 12  # one output per step
            for index in (0, 1):
                assert _per_index(got, index) == _per_index(expected, index)
            await assert_idle_and_free(engine)

    asyncio.run(main())


def _per_index(outputs: list[RequestOutput], index: int) -> tuple:
    completions = [c for o in outputs for c in o.outputs if c.index == index]
    return (
        [t for c in completions for t in c.token_ids],
        [lp for c in completions for lp in c.logprobs or []],
        completions[-1].finish_reason,
        completions[-1].cumulative_logprob,
    )


def test_a_request_finishing_among_many(model_dir) -> None:  # noqa: F811
    """Requests of different lengths in the same steps: each gets its own tokens (those of
    `generate`), one finished output, and nothing after it."""
    prompts = random_prompts(12, seed=3)
    lengths = [3 + (i % 4) * 5 for i in range(len(prompts))]

    async def main() -> None:
        with async_engine(model_dir) as engine:
            expected = [
                await collect(engine, ids(p), greedy(n), f"ref-{i}")
                for i, (p, n) in enumerate(zip(prompts, lengths))
            ]
            got = await asyncio.gather(
                *(
                    gather_into(engine, ids(p), greedy(n), f"into-{i}")
                    for i, (p, n) in enumerate(zip(prompts, lengths))
                )
            )
            for outputs, reference, n in zip(got, expected, lengths):
                assert joined_tokens(outputs) == joined_tokens(reference)
                assert len(joined_tokens(outputs)) == n
                assert [o.finished for o in outputs].count(True) == 1 and outputs[-1].finished
                assert outputs[-1].outputs[0].finish_reason == "length"
            await assert_idle_and_free(engine)

    asyncio.run(main())


def test_cancelled_caller_aborts_and_gets_nothing_more(model_dir) -> None:  # noqa: F811
    """One request cancelled among others in the same steps: the others run to the end,
    its blocks are freed, and its callback is not called once the caller is gone."""

    async def main() -> None:
        with async_engine(model_dir) as engine:
            seen: list[RequestOutput] = []
            cancelled_at: list[int] = []
            first = asyncio.Event()

            def on_output(output: RequestOutput) -> None:
                assert not cancelled_at, "an output came after the caller was cancelled"
                seen.append(output)
                first.set()

            others = [
                asyncio.create_task(gather_into(engine, ids(p), greedy(20), f"other-{i}"))
                for i, p in enumerate(random_prompts(4, seed=9))
            ]
            task = asyncio.create_task(
                engine.generate_into(ids([9, 10, 11]), greedy(200), "cancel-me", on_output)
            )
            await asyncio.wait_for(first.wait(), timeout=60)
            task.cancel()
            cancelled_at.append(len(seen))
            with pytest.raises(asyncio.CancelledError):
                await task
            for outputs in await asyncio.gather(*others):
                assert len(joined_tokens(outputs)) == 20 and outputs[-1].finished
            await assert_idle_and_free(engine, max_generated=4 * 20 + 100)
            assert not any(o.finished for o in seen)

    asyncio.run(main())


def test_abort_ends_with_finish_reason_abort(model_dir) -> None:  # noqa: F811
    async def main() -> None:
        with async_engine(model_dir) as engine:
            outputs: list[RequestOutput] = []

            def on_output(output: RequestOutput) -> None:
                outputs.append(output)
                if len(outputs) == 2:
                    asyncio.get_running_loop().create_task(engine.abort("abort-me"))

            await engine.generate_into(ids([3, 4, 5]), greedy(200), "abort-me", on_output)
            assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
            await assert_idle_and_free(engine, max_generated=50)

    asyncio.run(main())


def test_failing_callback_aborts_its_request_only(model_dir) -> None:  # noqa: F811
    async def main() -> None:
        with async_engine(model_dir) as engine:
            calls = []

            def on_output(output: RequestOutput) -> None:
                calls.append(output)
                if len(calls) == 2:
                    raise RuntimeError("the consumer broke")

            other = asyncio.create_task(gather_into(engine, ids([7, 8]), greedy(15), "fine"))
            with pytest.raises(RuntimeError, match="the consumer broke"):
                await engine.generate_into(ids([3, 4, 5]), greedy(200), "breaks", on_output)
            assert len(calls) == 2  # nothing handed over after the error
            assert len(joined_tokens(await other)) == 15
            await assert_idle_and_free(engine, max_generated=15 + 50)

    asyncio.run(main())


def test_bad_request_raises_the_engine_error(model_dir) -> None:  # noqa: F811
    async def main() -> None:
        with async_engine(model_dir) as engine:
            with pytest.raises(ValueError, match="not in the vocabulary"):
                await engine.generate_into(ids([10**9]), greedy(4), "bad", lambda o: None)
            with pytest.raises(TypeError, match="sampling_params"):
                await engine.generate_into(ids([1]), {"max_tokens": 4}, "bad", lambda o: None)
            assert len(joined_tokens(await gather_into(engine, ids([1, 2]), greedy(4), "ok"))) == 4
            await assert_idle_and_free(engine)

    asyncio.run(main())
