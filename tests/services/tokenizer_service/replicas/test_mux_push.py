"""The relay's reader on the multiplexed hop is pushed to, not a task of its own
(replicas/stream_mux.py `subscribe`, replicas/merging_reader.py), against the stack's real
engine service: what waited comes merged, one message per output, with the tokens, logprobs
and finish an iterated call gives; what was delivered before it subscribed comes too; a
cancel and a deadline end it after the messages before them."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagedserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.tokenizer_service.replicas.merging_reader import MergingReader
from services.tokenizer_service.replicas.stream_mux import EngineStreamMux
from tests.services.tokenizer_service.replicas.test_merging_reader import _per_index

PARAMS = dict(temperature=1.0, seed=5, n=2, max_tokens=30, ignore_eos=True, logprobs=1)
LONG = dict(temperature=0.0, max_tokens=2000, ignore_eos=True)


def _request(request_id: str, **sampling) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(
        request_id=request_id,
        prompt_token_ids=[5, 6, 7, 8],
        sampling_params=common_pb2.SamplingParams(**sampling),
    )


async def _open_mux(port: int, on_batch=None) -> tuple[grpc.aio.Channel, EngineStreamMux]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = engine_pb2_grpc.EngineServiceStub(channel)
    mux = EngineStreamMux(stub, f"127.0.0.1:{port}", on_batch)
    assert await mux.available()
    return channel, mux


def test_pushed_messages_that_waited_come_merged(stack) -> None:
    async def run():
        channel, mux = await _open_mux(stack.engine_port)
        direct = [msg async for msg in mux.generate(_request("push-direct", **PARAMS), 60)]
        num_arrived = num_taken = 0

        def arrived() -> None:
            nonlocal num_arrived
            num_arrived += 1

        def taken(n: int) -> None:
            nonlocal num_taken
            num_taken += n

        num_tasks = len(asyncio.all_tasks())
        call = mux.generate(_request("push-merged", **PARAMS), 60)
        reader = MergingReader(call, arrived, 1, taken)
        tasks_added = len(asyncio.all_tasks()) - num_tasks
        try:
            while not reader.call_ended:  # a relay that does not read meanwhile
                await asyncio.sleep(0.01)
            merged = [waiting.merged() async for waiting in reader]
        finally:
            reader.close()
        await mux.close()
        await channel.close()
        return direct, merged, num_arrived, num_taken, tasks_added

    direct, merged, num_arrived, num_taken, tasks_added = stack.loop.run(run())
    assert tasks_added == 0  # no reader task: the mux's reader pushes
    assert len(direct) > 2 and num_taken > 2  # more messages than outputs came
    assert num_arrived == 2  # pushed: the subscriber hears once per waiting output
    assert len(merged) == 2  # one per output index
    assert _per_index(merged) == _per_index(direct)
    assert {m.finish_reason for m in merged} == {common_pb2.FINISH_REASON_LENGTH}
    stack.wait_until_idle()


def test_what_came_before_the_subscription_is_pushed(stack) -> None:
    async def run():
        channel, mux = await _open_mux(stack.engine_port)
        call = mux.generate(_request("push-late", temperature=0.0, max_tokens=12), 60)
        while not call.done():  # every message and the end wait in the call
            await asyncio.sleep(0.01)
        reader = MergingReader(call, lambda: None)
        got = [waiting.merged() async for waiting in reader]
        await mux.close()
        await channel.close()
        return got

    got = stack.loop.run(run())
    assert sum(len(m.token_ids) for m in got) == 12
    assert got[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    stack.wait_until_idle()


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_the_end_comes_after_the_messages_before_it(stack, how) -> None:
    async def run():
        count = 0

        def batch_came() -> None:  # each batch holds one of this call's messages
            nonlocal count
            count += 1

        channel, mux = await _open_mux(stack.engine_port, batch_came)
        call = mux.generate(_request(f"push-{how}", **LONG), 60 if how == "cancel" else 2.0)
        reader = MergingReader(call, lambda: None)
        got: list = []
        error: BaseException | None = None
        num_before = 0
        try:
            if how == "cancel":
                while count < 3:
                    await asyncio.sleep(0.01)
                call.cancel()  # as the replica watch does with a stalled replica
                num_before = count  # (later batches carry nothing for it)
            async for waiting in reader:
                got.append(waiting.merged())
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as exc:
            error = exc
        finally:
            reader.close()
        await mux.close()
        await channel.close()
        return got, error, num_before

    got, error, count = stack.loop.run(run())
    num_tokens = sum(len(m.token_ids) for m in got)
    if how == "cancel":
        assert isinstance(error, asyncio.CancelledError)
        assert num_tokens >= count >= 3  # every message pushed before the cancel came out
    else:
        assert isinstance(error, grpc.aio.AioRpcError)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert num_tokens < LONG["max_tokens"]
    stack.wait_until_idle()


def test_a_consumer_that_fails_ends_its_request_only(stack) -> None:
    async def run():
        channel, mux = await _open_mux(stack.engine_port)
        failing = mux.generate(_request("push-fails", **LONG), 60)
        other = mux.generate(_request("push-other", temperature=0.0, max_tokens=10), 60)
        ended: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_response(response) -> None:
            raise ValueError("a consumer's bug")

        failing.subscribe(on_response, ended.set_result)
        error = await asyncio.wait_for(ended, 60)
        got = [msg async for msg in other]  # the call goes on for the others
        await mux.close()
        await channel.close()
        return error, got

    error, got = stack.loop.run(run())
    assert isinstance(error, ValueError)
    assert sum(len(m.token_ids) for m in got) == 10
    stack.wait_until_idle()  # the failed request was aborted on the engine
