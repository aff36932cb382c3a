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
