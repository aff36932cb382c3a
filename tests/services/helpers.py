"""Building requests and gathering streamed answers in the service tests."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.v1 import common_pb2, generation_pb2


@dataclass
class StreamedOutput:
    """One output index of a streamed answer, put back together."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.PositionLogprobs] = field(default_factory=list)
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    stop_reason: common_pb2.StopReason | None = None
    num_messages: int = 0
    usage: common_pb2.Usage | None = None


def gather(responses: Iterable[generation_pb2.GenerateResponse]) -> dict[int, StreamedOutput]:
    outputs: dict[int, StreamedOutput] = {}
    for response in responses:
        out = outputs.setdefault(response.index, StreamedOutput())
        assert out.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED, "message after the end"
        out.text += response.text
        out.token_ids += response.token_ids
        out.logprobs += response.logprobs
        out.num_messages += 1
        out.usage = response.usage
        if response.finish_reason:
            out.finish_reason = response.finish_reason
            out.stop_reason = response.stop_reason if response.HasField("stop_reason") else None
    return outputs


def token_prompts(num: int, seed: int = 0, vocab_size: int = 49152) -> list[list[int]]:
    """Random token-id prompts of 3..40 tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(3, 40))] for _ in range(num)]


def request(
    *,
    token_ids: list[int] | None = None,
    text: str | None = None,
    request_id: str = "",
    **sampling: object,
) -> generation_pb2.GenerateRequest:
    msg = generation_pb2.GenerateRequest(
        request_id=request_id, sampling_params=common_pb2.SamplingParams(**sampling)
    )
    if token_ids is not None:
        msg.token_ids.SetInParent()  # selects the oneof even for an empty list
        msg.token_ids.ids.extend(token_ids)
    if text is not None:
        msg.text = text
    return msg


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.02):
    """Polls `predicate` until it returns something truthy; returns that, or fails. The
    deadline is generous: it only matters when the condition never comes, and a loaded
    2-core machine may take many seconds for one that does."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"still false after {timeout} s: {predicate}")
        time.sleep(interval)
