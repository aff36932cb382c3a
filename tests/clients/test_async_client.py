"""`AsyncClient` against real in-process services (tiny model)."""

from __future__ import annotations

import asyncio

import pytest

from clients import AsyncClient, DeadlineExceededError, InvalidArgumentError
from tests.services.helpers import token_prompts

PROMPT = token_prompts(1, seed=31)[0]


def test_async_streams_text_rpcs_and_errors(address, stack):
    async def main() -> None:
        async with AsyncClient(address, timeout=60) as client:
            deltas = [
                d async for d in client.generate(token_ids=PROMPT, temperature=0, max_tokens=10)
            ]
            result = await client.generate_text(token_ids=PROMPT, temperature=0, max_tokens=10)
            assert "".join(d.text for d in deltas) == result.text
            assert [t for d in deltas for t in d.token_ids] == result.outputs[0].token_ids
            assert result.finish_reasons == ["length"] and result.usage.completion_tokens == 10

            chat = await client.chat([{"role": "user", "content": "hi"}], max_tokens=4)
            assert chat.usage.completion_tokens <= 4 and chat.outputs[0].finish_reason

            tokens = await client.tokenize("Hello world")
            assert await client.detokenize(tokens.token_ids) == "Hello world"
            assert len((await client.encode("Hello world"))[0]) == 64
            assert (await client.model_info()).vocab_size == 49152
            assert (await client.health()).status == "SERVING"

            with pytest.raises(InvalidArgumentError, match=r"sampling_params\.temperature"):
                await client.generate_text(token_ids=PROMPT, temperature=-1.0)
            with pytest.raises(DeadlineExceededError):
                await client.generate_text(
                    token_ids=PROMPT, max_tokens=480, ignore_eos=True, timeout=0.3
                )

    asyncio.run(main())
    stack.wait_until_idle()


def test_async_break_and_task_cancel_abort_server_side(address, stack):
    stack.wait_until_idle()
    before = stack.stats().num_generation_tokens_total

    async def main() -> None:
        async with AsyncClient(address) as client:
            async with client.generate(token_ids=PROMPT, max_tokens=480, ignore_eos=True) as s:
                async for _ in s:
                    break
            # Cancelling the consuming task cancels the call too.
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in client.generate(token_ids=PROMPT, max_tokens=480, ignore_eos=True):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    stack.wait_until_idle()
    assert stack.stats().num_generation_tokens_total - before < 2 * 480
