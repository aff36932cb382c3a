"""Fewer, fuller messages when a stream's consumer is behind, over real gRPC: every token
produced since the last send goes in one message, and what the client puts back together
(tokens, text, logprobs, finish reasons, usage, cumulative logprob) is what a consumer that
kept up got."""

from __future__ import annotations

import time

import pytest

from pagedserve.v1 import common_pb2
from tests.services.helpers import gather, request, token_prompts

PARAMS = {
    "temperature": 1.0,
    "seed": 11,
    "n": 2,
    "max_tokens": 40,
    "ignore_eos": True,
    "logprobs": 2,
}


def _summary(responses) -> dict[int, tuple]:
    return {
        index: (
            out.text,
            out.token_ids,
            [(p.chosen.token_id, round(p.chosen.logprob, 5)) for p in out.logprobs],
            [[(e.token_id, e.rank, e.text) for e in p.top] for p in out.logprobs],
            out.finish_reason,
            (out.usage.prompt_tokens, out.usage.completion_tokens),
        )
        for index, out in gather(responses).items()
    }


def _last_cumulative(responses, index: int) -> float:
    return [r for r in responses if r.index == index][-1].cumulative_logprob


@pytest.mark.parametrize("with_stop", [False, True])
def test_a_consumer_that_falls_behind_gets_the_same_answer_in_fuller_messages(
    stack, with_stop
) -> None:
    prompt = token_prompts(1, seed=3)[0]
    params = dict(PARAMS)
    fast = list(stack.public.Generate(request(token_ids=prompt, **params)))
    if with_stop:  # a piece of output 0's text late in it: the stop string ends it there
        text = gather(fast)[0].text
        params["stop"] = [text[len(text) * 3 // 4 :][:3]]
        fast = list(stack.public.Generate(request(token_ids=prompt, **params)))
        assert common_pb2.FINISH_REASON_STOP in {r.finish_reason for r in fast}
        assert len(gather(fast)[0].token_ids) > 10
    # (Whether `fast` kept up, one message per token, depends on the machine's load: the
    # reference is its content, not its message count.)

    slow = []
    stream = stack.public.Generate(request(token_ids=prompt, **params))
    slow.append(next(stream))
    # The services' event loop stops while the engine thread goes on stepping: every
    # token of those steps waits, and goes out in one message per output afterwards.
    stack.loop.loop.call_soon_threadsafe(time.sleep, 0.5)
    slow += list(stream)

    assert max(len(r.token_ids) for r in slow) > 1  # tokens that waited went out together
    assert _summary(slow) == _summary(fast)
    for index in (0, 1):
        assert _last_cumulative(slow, index) == pytest.approx(_last_cumulative(fast, index))
    if not with_stop:
        assert {r.finish_reason for r in slow if r.finish_reason} == {
            common_pb2.FINISH_REASON_LENGTH
        }
    stack.wait_until_idle()


@pytest.fixture(scope="module")
def interval_stub(stack):
    """A second tokenizer service on the same engine, with a stream interval of 4 tokens."""
    import grpc

    from pagedserve.v1 import generation_pb2_grpc

    server = stack.start_tokenizer_server(stream_interval=4)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield generation_pb2_grpc.TextGenerationServiceStub(channel)
    channel.close()
    stack.loop.run(server.stop(0))


@pytest.mark.parametrize("with_stop", [False, True])
def test_a_stream_interval_sends_tokens_in_fours_with_the_same_answer(
    stack, interval_stub, with_stop
) -> None:
    prompt = token_prompts(1, seed=5)[0]
    params = dict(PARAMS, max_tokens=30)
    reference = list(stack.public.Generate(request(token_ids=prompt, **params)))
    if with_stop:  # ends output 0 mid-way, inside a group of four
        text = gather(reference)[0].text
        params["stop"] = [text[len(text) // 2 :][:3]]
        reference = list(stack.public.Generate(request(token_ids=prompt, **params)))
    grouped = list(interval_stub.Generate(request(token_ids=prompt, **params)))

    assert _summary(grouped) == _summary(reference)
    for index in (0, 1):
        sizes = [len(r.token_ids) for r in grouped if r.index == index]
        finished = [r.finish_reason for r in grouped if r.index == index]
        assert sizes[0] >= 1  # the first token is not held
        # Every message between the first and the one that ends the output held 4 or more.
        assert all(size >= 4 for size in sizes[1:-1]), sizes
        assert finished[-1] and not any(finished[:-1])
        assert _last_cumulative(grouped, index) == pytest.approx(_last_cumulative(reference, index))
    assert len(grouped) < sum(len(r.token_ids) for r in grouped)
    stack.wait_until_idle()


def test_a_stream_interval_below_one_is_refused() -> None:
    from services.cli.flags import build_parser
    from services.tokenizer_service.config import TokenizerServerConfig

    with pytest.raises(ValueError, match="stream_interval must be at least 1, got 0"):
        TokenizerServerConfig(address="127.0.0.1:0", engine_address="x:1", stream_interval=0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tokenizer", "--stream-interval", "0"])
