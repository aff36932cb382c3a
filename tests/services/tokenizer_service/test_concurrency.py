"""Many concurrent streams; cancelled ones (client cancel and Abort RPC) free the engine."""

from __future__ import annotations

import asyncio

import grpc

from engine import SamplingParams
from pagedserve.v1 import common_pb2, generation_pb2_grpc
from tests.services.helpers import gather, request, token_prompts, wait_for

NUM_STREAMS = 64
MAX_TOKENS = 32
CANCELLED = set(range(0, NUM_STREAMS, 4))  # 16 streams: half cancel, half Abort
CLIENT_CANCELLED = {i for i in CANCELLED if i % 8 == 0}


async def _run_streams(port: int, prompts: list[list[int]]) -> list[tuple[str, list]]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.TextGenerationServiceStub(channel)

        async def one(i: int) -> tuple[str, list]:
            req = request(
                token_ids=prompts[i],
                request_id=f"conc-{i}",
                temperature=0,
                max_tokens=MAX_TOKENS,
                ignore_eos=True,
            )
            call = stub.Generate(req, timeout=120)
            responses = []
            async for response in call:
                responses.append(response)
                if i in CANCELLED and len(responses) == 3:
                    if i in CLIENT_CANCELLED:
                        call.cancel()
                        return "cancelled", responses
                    reply = await stub.Abort(common_pb2.AbortRequest(request_ids=[f"conc-{i}"]))
                    assert list(reply.aborted_request_ids) == [f"conc-{i}"]
            return "done", responses

        return await asyncio.gather(*(one(i) for i in range(NUM_STREAMS)))


def test_64_streams_and_16_cancelled_leave_the_engine_idle(stack, offline_llm):
    prompts = token_prompts(NUM_STREAMS, seed=10)
    expected = offline_llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    results = asyncio.run(_run_streams(stack.public_port, prompts))

    for i, ((how, responses), exp) in enumerate(zip(results, expected)):
        out = gather(responses)[0]
        exp_ids = exp.outputs[0].token_ids
        if i in CLIENT_CANCELLED:
            assert how == "cancelled"
            assert out.token_ids == exp_ids[: len(out.token_ids)]
        elif i in CANCELLED:
            assert out.finish_reason == common_pb2.FINISH_REASON_ABORT, i
            assert len(out.token_ids) < MAX_TOKENS
            assert out.token_ids == exp_ids[: len(out.token_ids)]
        else:
            assert out.finish_reason == common_pb2.FINISH_REASON_LENGTH, i
            assert out.token_ids == exp_ids, i
            assert out.text == exp.outputs[0].text

    stats = stack.wait_until_idle()
    assert stats.num_free_blocks == stats.num_total_blocks
    # The same, as the services report it (their handlers finish just after the engine).
    health = wait_for(lambda: _idle_health(stack.engine_stub, "num_inflight_streams"))
    assert health.details["num_running_requests"] == "0"
    assert health.details["num_waiting_requests"] == "0"
    assert health.details["num_free_kv_blocks"] == health.details["num_kv_blocks"]
    public = wait_for(lambda: _idle_health(stack.public, "num_inflight_requests"))
    assert public.details["engine.num_running_requests"] == "0"


def _idle_health(stub, key: str):
    health = stub.Health(common_pb2.HealthRequest())
    return health if health.details[key] == "0" else None
