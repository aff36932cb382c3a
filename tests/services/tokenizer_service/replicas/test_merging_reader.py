"""The tokenizer service reads an engine call ahead of its client and merges what waits
(services/tokenizer_service/replicas/merging_reader.py), over a real engine service call."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagedserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.tokenizer_service.replicas.merging_reader import MergingReader

PARAMS = common_pb2.SamplingParams(
    temperature=1.0, seed=5, n=2, max_tokens=30, ignore_eos=True, logprobs=1
)


def _request(request_id: str) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(
        request_id=request_id, prompt_token_ids=[5, 6, 7, 8], sampling_params=PARAMS
    )


def _per_index(messages) -> dict[int, tuple]:
    result: dict[int, tuple] = {}
    for msg in messages:
        tokens, logprobs, *_ = result.get(msg.index, ([], [], 0, None, None))
        result[msg.index] = (
            tokens + list(msg.token_ids),
            logprobs + [round(p.chosen.logprob, 5) for p in msg.logprobs],
            msg.finish_reason,
            msg.usage.completion_tokens,
            round(msg.cumulative_logprob, 4),
        )
    return result


def test_messages_that_waited_come_as_one_per_output(stack) -> None:
    async def run() -> tuple[list, list, int]:
        address = f"127.0.0.1:{stack.engine_port}"
        async with grpc.aio.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            direct = [msg async for msg in stub.Generate(_request("merge-direct"))]
            num_arrived = 0

            def arrived() -> None:
                nonlocal num_arrived
                num_arrived += 1

            reader = MergingReader(stub.Generate(_request("merge-read-ahead")), arrived)
            try:
                # A client that does not read meanwhile. (Not a count of `direct`'s
                # messages: on a busy machine the engine service merges some itself.)
                while not reader.call_ended:
                    await asyncio.sleep(0.01)
                merged = [waiting.merged() async for waiting in reader]
            finally:
                reader.close()
            return direct, merged, num_arrived

    direct, merged, num_arrived = stack.loop.run(run())
    assert len(direct) > 2 and num_arrived > 2  # more messages than outputs came
    assert len(merged) == 2  # one per output index
    assert _per_index(merged) == _per_index(direct)
    assert {m.finish_reason for m in merged} == {common_pb2.FINISH_REASON_LENGTH}


def test_the_call_error_comes_after_the_messages_before_it(stack) -> None:
    async def run() -> list:
        address = f"127.0.0.1:{stack.engine_port}"
        async with grpc.aio.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            long = engine_pb2.EngineGenerateRequest(
                request_id="merge-cancelled",
                prompt_token_ids=[5, 6, 7],
                sampling_params=common_pb2.SamplingParams(
                    temperature=0.0, max_tokens=2000, ignore_eos=True
                ),
            )
            call = stub.Generate(long)
            count = 0

            def arrived() -> None:
                nonlocal count
                count += 1

            reader = MergingReader(call, arrived)
            got: list = []
            try:
                while count < 3:
                    await asyncio.sleep(0.01)
                call.cancel()  # as the replica watch does with a stalled replica
                with pytest.raises(asyncio.CancelledError):
                    async for waiting in reader:
                        got.append(waiting.merged())
            finally:
                reader.close()
            return got

    got = stack.loop.run(run())
    assert got and sum(len(m.token_ids) for m in got) >= 3  # delivered before the error
    stack.wait_until_idle()
