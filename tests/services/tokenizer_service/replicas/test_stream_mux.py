"""The tokenizer service's multiplexed engine call (replicas/stream_mux.py) over real gRPC.

Through the public API: the session's tokenizer service (multiplexed, the default) and one
forced to per-request calls answer the same requests alike, and the multiplexed one sends
fewer engine messages than tokens. On one `EngineStreamMux` against the stack's engine
service: a bad request fails alone, a deadline and a cancel abort on the engine, a drained
engine hands every request back with the migrate status, an engine without GenerateStream
gets per-request calls.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from pagedserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc, generation_pb2_grpc
from services.common.grpc_server import HealthReporter, create_server
from services.common.migration import REASON_DRAINED, migrate_reason
from services.engine_service.server import EngineServer, EngineServerConfig
from services.engine_service.servicer import EngineServicer
from services.tokenizer_service.replicas.engine_client import EngineBackend
from services.tokenizer_service.replicas.stream_mux import EngineStreamMux
from tests.services.helpers import gather, request, token_prompts, wait_for

PROMPTS = token_prompts(6, seed=77)
LONG = dict(max_tokens=2000, ignore_eos=True)


def engine_request(request_id: str, prompt: list[int], **sampling):
    return engine_pb2.EngineGenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=common_pb2.SamplingParams(**sampling),
    )


@pytest.fixture(scope="module")
def per_request_server(stack):
    server = stack.start_tokenizer_server(engine_multiplex=False)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield server, generation_pb2_grpc.TextGenerationServiceStub(channel)
    channel.close()
    stack.loop.run(server.stop(0))


def the_replica(server):
    (replica,) = server.backend.replicas.values()
    return replica


def reset_prefix_cache(stack) -> None:
    """Both runs prefill every prompt alike (a cache hit prefills less: other float noise)."""
    stack.loop.run(stack.engine.reset_prefix_cache())


CASES = [
    dict(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
    dict(temperature=1.0, seed=9, n=2, max_tokens=10, ignore_eos=True, logprobs=1),
    dict(temperature=0, max_tokens=24, stop=["a", "e"], include_stop_str_in_output=True),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_multiplexed_answers_as_per_request_calls(stack, per_request_server, case) -> None:
    _, per_request = per_request_server
    muxed = the_replica(stack.tokenizer_server).stream_mux
    batches_before = muxed.num_batches
    results = []
    for public in (per_request, stack.public):
        reset_prefix_cache(stack)
        req = request(token_ids=PROMPTS[case], request_id=f"mux-vs-{case}", **CASES[case])
        outputs = gather(public.Generate(req, timeout=60))
        for out in outputs.values():
            out.num_messages = 0  # a relay behind its engine merges messages
        results.append(outputs)
        # A stop string ends the client's stream before the engine has taken the abort in;
        # the same request_id is free again only once it has.
        stack.wait_until_idle()
    assert results[0] == results[1]
    assert all(out.finish_reason for out in results[1].values())
    assert muxed.num_batches > batches_before  # the second one went over the mux


def test_per_request_switch_opens_no_multiplexed_call(per_request_server) -> None:
    server, _ = per_request_server
    assert the_replica(server).stream_mux is None


def test_concurrent_streams_share_engine_messages(stack) -> None:
    muxed = the_replica(stack.tokenizer_server).stream_mux
    num_streams, max_tokens = 24, 16
    batches_before = muxed.num_batches

    async def run() -> list:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.public_port}") as channel:
            stub = generation_pb2_grpc.TextGenerationServiceStub(channel)

            async def one(i: int):
                req = request(
                    token_ids=token_prompts(num_streams, seed=5)[i],
                    request_id=f"mux-many-{i}",
                    temperature=0,
                    max_tokens=max_tokens,
                    ignore_eos=True,
                )
                return [r async for r in stub.Generate(req, timeout=120)]

            return await asyncio.gather(*(one(i) for i in range(num_streams)))

    results = asyncio.run(run())
    for responses in results:
        out = gather(responses)[0]
        assert len(out.token_ids) == max_tokens
        assert out.finish_reason == common_pb2.FINISH_REASON_LENGTH
    num_tokens = num_streams * max_tokens
    num_batches = muxed.num_batches - batches_before
    # Per-request calls carry about one engine message per token here; the mux far fewer.
    assert 0 < num_batches < num_tokens / 2
    stack.wait_until_idle()


def test_client_cancel_aborts_on_the_engine(stack) -> None:
    total = stack.stats().num_total_blocks
    call = stack.public.Generate(
        request(token_ids=PROMPTS[0], request_id="mux-client-cancel", **LONG), timeout=120
    )
    next(iter(call))
    wait_for(lambda: stack.stats().num_running == 1)
    call.cancel()
    stats = stack.wait_until_idle()
    assert stats.num_free_blocks == total


# ---- one EngineStreamMux against a real engine service ---------------------------------


async def _open_mux(port: int) -> tuple[grpc.aio.Channel, EngineStreamMux]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    mux = EngineStreamMux(engine_pb2_grpc.EngineServiceStub(channel), f"127.0.0.1:{port}")
    assert await mux.available()
    return channel, mux


async def _read(call) -> tuple[list[int], BaseException | None]:
    token_ids: list[int] = []
    try:
        async for response in call:
            token_ids += response.token_ids
    except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
        return token_ids, exc
    return token_ids, None


def test_bad_request_fails_alone(stack) -> None:
    async def run():
        channel, mux = await _open_mux(stack.engine_port)
        good = mux.generate(engine_request("mux-ok", PROMPTS[1], max_tokens=8), 60)
        bad = mux.generate(engine_request("mux-bad", PROMPTS[2], top_p=2.0), 60)
        results = await asyncio.gather(_read(good), _read(bad))
        await mux.close()
        await channel.close()
        return results

    (good_ids, good_error), (bad_ids, bad_error) = stack.loop.run(run())
    assert good_error is None and len(good_ids) == 8
    assert bad_ids == [] and bad_error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.top_p" in bad_error.details()
    stack.wait_until_idle()


@pytest.mark.parametrize("how", ["deadline", "cancel"])
def test_deadline_and_cancel_abort_on_the_engine(stack, how) -> None:
    async def run():
        channel, mux = await _open_mux(stack.engine_port)
        call = mux.generate(
            engine_request(f"mux-{how}", PROMPTS[3], **LONG), 0.5 if how == "deadline" else 60
        )
        reading = asyncio.ensure_future(_read(call))
        if how == "cancel":
            while not call._responses and not reading.done():
                await asyncio.sleep(0.01)
            call.cancel()
        result = await reading
        await channel.close()  # the call stays open until here: only the request ended
        return result

    token_ids, error = stack.loop.run(run())
    if how == "deadline":
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    else:
        assert isinstance(error, asyncio.CancelledError)
    assert len(token_ids) < LONG["max_tokens"]
    stack.wait_until_idle()


def test_drained_engine_hands_every_request_back(stack) -> None:
    async def run():
        server = EngineServer(EngineServerConfig(address="127.0.0.1:0", shutdown_grace_s=0.0))
        port = await server.start()
        await server.attach_engine(stack.engine)
        channel, mux = await _open_mux(port)
        calls = [
            mux.generate(engine_request(f"mux-drain-{i}", p, **LONG), 60)
            for i, p in enumerate(PROMPTS[:3])
        ]
        readers = [asyncio.ensure_future(_read(c)) for c in calls]
        while not all(c._responses for c in calls):
            await asyncio.sleep(0.01)
        await server.stop()
        results = await asyncio.gather(*readers)
        await channel.close()
        return results

    for token_ids, error in stack.loop.run(run()):
        assert token_ids
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert migrate_reason(error) == REASON_DRAINED
    stack.wait_until_idle()


class OlderEngineServicer(EngineServicer):
    """An engine service from before GenerateStream: the generated base answers it
    UNIMPLEMENTED."""

    GenerateStream = engine_pb2_grpc.EngineServiceServicer.GenerateStream


def test_engine_without_generate_stream_gets_per_request_calls(stack, caplog) -> None:
    async def run():
        server = create_server()
        servicer = OlderEngineServicer(HealthReporter(server, []), 16)
        servicer.engine = stack.engine
        engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()

        async def on_health_change(available: bool, reason: str) -> None:
            pass

        replica = EngineBackend(f"127.0.0.1:{port}", on_health_change)
        results = []
        for i in range(2):
            call = await replica.open_generate(
                engine_request(f"old-{i}", PROMPTS[4], max_tokens=5), 60, ()
            )
            results.append(await _read(call))
        supported = replica.stream_mux.supported
        await replica.close()
        await server.stop(0)
        return results, supported

    with caplog.at_level(logging.WARNING, logger="services.tokenizer_service.replicas"):
        results, supported = stack.loop.run(run())
    assert supported is False
    assert all(error is None and len(ids) == 5 for ids, error in results)
    said = [r for r in caplog.records if "no GenerateStream" in r.getMessage()]
    assert len(said) == 1
    stack.wait_until_idle()


def test_a_request_id_is_free_again_right_after_a_stop_string(stack) -> None:
    """A stop string ends the client's stream at the tokenizer, which aborts the engine's
    request over the multiplexed call; the client asking again with the same request_id at
    once is served (the engine takes the start in after the abort), not refused as a live id."""
    stop = dict(temperature=0, max_tokens=200, stop=["a", "e", "o", "s", "t"])
    for _ in range(6):
        req = request(token_ids=PROMPTS[5], request_id="stop-then-again", **stop)
        (out,) = gather(stack.public.Generate(req, timeout=60)).values()  # raises if refused
        assert out.finish_reason == common_pb2.FINISH_REASON_STOP
        assert out.stop_reason.text in stop["stop"]
    stack.wait_until_idle()
