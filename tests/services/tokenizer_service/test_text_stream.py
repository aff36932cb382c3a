"""One request's `TextStream` (services/tokenizer_service/text_stream.py) on engine messages
built here, with the default model's tokenizer: the same tokens one per message or merged
give the same text, usage, logprobs and finish; fields at their default stay unset and
others pass through; the stream is finished once every output has ended, by the engine, a
stop string or `abort_unfinished`."""

from __future__ import annotations

import random

import pytest

from pagedserve.v1 import common_pb2, engine_pb2
from services.tokenizer_service.sampling import RequestSampling
from services.tokenizer_service.text_stream import TextStream, TokenTexts

PROMPT = [1, 504, 3458, 314, 260]


def _stream(tokenizer, **sampling) -> TextStream:
    params = RequestSampling(common_pb2.SamplingParams(**sampling), {})
    return TextStream("req", tokenizer, PROMPT, params, TokenTexts(tokenizer))


def _messages(token_ids: list[int], chunk: int, index: int = 0, logprobs: bool = False):
    """Engine messages for one output: `chunk` tokens each, the last one LENGTH."""
    out = []
    for start in range(0, len(token_ids), chunk):
        ids = token_ids[start : start + chunk]
        msg = engine_pb2.EngineGenerateResponse(
            request_id="req",
            index=index,
            token_ids=ids,
            usage=common_pb2.Usage(prompt_tokens=len(PROMPT), completion_tokens=start + len(ids)),
        )
        if logprobs:
            for i, token_id in enumerate(ids):
                msg.logprobs.add().chosen.CopyFrom(
                    common_pb2.TokenLogprob(token_id=token_id, logprob=-0.5 * (start + i + 1))
                )
            msg.cumulative_logprob = sum(-0.5 * (k + 1) for k in range(start + len(ids)))
        out.append(msg)
    out[-1].finish_reason = common_pb2.FINISH_REASON_LENGTH
    return out


def _run(stream: TextStream, messages) -> dict:
    text, ids, logprobs, last = "", [], [], None
    for msg in messages:
        response = stream.process(msg)
        if response is None:
            continue
        text += response.text
        ids += response.token_ids
        logprobs += [
            (p.chosen.token_id, p.chosen.logprob, p.chosen.text) for p in response.logprobs
        ]
        last = response
    assert last is not None
    return {
        "text": text,
        "ids": ids,
        "logprobs": logprobs,
        "finish": last.finish_reason,
        "usage": (last.usage.prompt_tokens, last.usage.completion_tokens),
        "cumulative": last.cumulative_logprob,
        "has_cumulative": last.HasField("cumulative_logprob"),
    }


@pytest.mark.parametrize("logprobs", [False, True])
def test_one_token_per_message_or_merged_alike(tokenizer, logprobs) -> None:
    rng = random.Random(3)
    token_ids = [rng.randrange(100, 40000) for _ in range(40)]
    sampling = {"logprobs": 0} if logprobs else {}
    single = _run(_stream(tokenizer, **sampling), _messages(token_ids, 1, logprobs=logprobs))
    merged = _run(_stream(tokenizer, **sampling), _messages(token_ids, 7, logprobs=logprobs))
    assert single == merged
    assert single["ids"] == token_ids
    assert single["text"] == tokenizer.decode(PROMPT + token_ids)[len(tokenizer.decode(PROMPT)) :]
    assert single["finish"] == common_pb2.FINISH_REASON_LENGTH
    assert single["usage"] == (len(PROMPT), 40)
    assert single["has_cumulative"] is logprobs
    if logprobs:
        assert [lp[0] for lp in single["logprobs"]] == token_ids
        assert all(lp[2] == tokenizer.decode([lp[0]]) for lp in single["logprobs"])
        assert single["cumulative"] == pytest.approx(sum(-0.5 * (k + 1) for k in range(40)))


def test_fields_at_their_default_stay_unset_and_others_pass(tokenizer) -> None:
    stream = _stream(tokenizer, n=2)
    first = _messages([600], 1, index=0)[0]
    first.ClearField("finish_reason")
    second = _messages([601], 1, index=1)[0]
    second.ClearField("finish_reason")
    second.usage.cached_tokens = 4
    a, b = stream.process(first), stream.process(second)
    assert a.index == 0 and not a.usage.cached_tokens and not a.HasField("stop_reason")
    assert b.index == 1 and b.usage.cached_tokens == 4
    assert not a.logprobs and not a.HasField("cumulative_logprob")
    assert (a.request_id, b.request_id) == ("req", "req")


def test_finished_once_every_output_has_ended(tokenizer) -> None:
    stream = _stream(tokenizer, n=3, stop=["zz"])
    assert not stream.finished
    stream.process(_messages([600, 601], 2, index=0)[0])  # LENGTH
    assert not stream.finished and stream.finish_reasons == ["length", "", ""]
    ended = stream.process(_messages(tokenizer.encode("a zz b", add_special_tokens=False), 9, 1)[0])
    assert ended.finish_reason == common_pb2.FINISH_REASON_STOP and ended.stop_reason.text == "zz"
    assert stream.process(_messages([602], 1, index=1)[0]) is None  # ended here already
    assert not stream.finished
    aborts = stream.abort_unfinished()
    assert [r.index for r in aborts] == [2]
    assert aborts[0].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert stream.finished and stream.finish_reasons == ["length", "stop", "abort"]
    assert stream.abort_unfinished() == []
