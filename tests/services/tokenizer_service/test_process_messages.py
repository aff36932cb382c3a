"""An output's waiting engine messages taken in one pass (`TextStream.process_messages` on a
`MergingReader`'s `WaitingOutput`) give the client the same messages as the per-message
path they replace (the messages merged into one with `merge_engine_messages`, then
`TextStream.process`): random splits of random outputs into engine messages and of those
into groups, with multi-byte characters split across groups, special tokens skipped or
kept, stop strings, logprobs and n = 2 interleaved; and the reader groups pushed messages
by output and by the stream interval."""

from __future__ import annotations

import asyncio
import random

import pytest

from pagedserve.v1 import common_pb2, engine_pb2
from services.tokenizer_service.replicas.merging_reader import (
    MergingReader,
    WaitingOutput,
    merge_engine_messages,
)
from services.tokenizer_service.sampling import RequestSampling
from services.tokenizer_service.text_stream import TextStream, TokenTexts
from tests.services.tokenizer_service.test_text_stream import PROMPT


def _pieces(tokenizer) -> list[int]:
    """Token ids where text is held back or changes: byte pieces of multi-byte characters,
    special tokens, spaces; plus ordinary words."""
    backend = tokenizer.backend_tokenizer
    ids = [i for t, i in backend.get_vocab(with_added_tokens=True).items() if t.startswith("<|")]
    for text in ("é🙂日本ꙮ👍🏽 ∑", " \n\t ", " the cat sat on a mat"):
        ids += backend.encode(text, add_special_tokens=False).ids
    return sorted(set(ids))


def _output(rng: random.Random, pieces: list[int], index: int, num_tokens: int) -> list:
    """One output's engine messages: 1-3 tokens each, running usage, logprobs and
    cumulative logprob, the last one LENGTH."""
    token_ids = [
        rng.choice(pieces) if rng.random() < 0.6 else rng.randrange(100, 40000)
        for _ in range(num_tokens)
    ]
    messages, start, total = [], 0, 0.0
    while start < num_tokens:
        ids = token_ids[start : start + rng.randint(1, 3)]
        msg = engine_pb2.EngineGenerateResponse(
            request_id="req",
            index=index,
            token_ids=ids,
            usage=common_pb2.Usage(prompt_tokens=len(PROMPT), completion_tokens=start + len(ids)),
        )
        for token_id in ids:
            logprob = -rng.random()
            total += logprob
            position = msg.logprobs.add()
            position.chosen.token_id, position.chosen.logprob = token_id, logprob
            position.top.add(token_id=token_id, logprob=logprob)
        msg.cumulative_logprob = total
        if start == 0:
            msg.prompt_logprobs.add()
            msg.usage.cached_tokens = 2
        messages.append(msg)
        start += len(ids)
    messages[-1].finish_reason = common_pb2.FINISH_REASON_LENGTH
    return messages


def _interleaved(rng: random.Random, outputs: list[list]) -> list:
    queues = [list(o) for o in outputs]
    order = []
    while any(queues):
        queue = rng.choice([q for q in queues if q])
        order.append(queue.pop(0))
    return order


def _groups(rng: random.Random, messages: list) -> list[list]:
    """Consecutive messages of one output index, as the reader hands them over."""
    groups: list[list] = []
    pending: dict[int, list] = {}
    for msg in messages:
        pending.setdefault(msg.index, []).append(msg)
        if rng.random() < 0.35 or msg.finish_reason:
            groups.append(pending.pop(msg.index))
    return groups + list(pending.values())


def _copy(msg):
    return engine_pb2.EngineGenerateResponse.FromString(msg.SerializeToString())


def _stream(tokenizer, sampling: dict) -> TextStream:
    params = RequestSampling(common_pb2.SamplingParams(**sampling), {})
    return TextStream("req", tokenizer, PROMPT, params, TokenTexts(tokenizer))


def _wire(response) -> bytes | None:
    return None if response is None else response.SerializeToString(deterministic=True)


@pytest.mark.parametrize("seed", range(40))
def test_a_group_gives_what_its_merged_message_gives(tokenizer, seed) -> None:
    rng = random.Random(seed)
    pieces = _pieces(tokenizer)
    n = rng.choice([1, 2])
    outputs = [_output(rng, pieces, i, rng.randint(1, 30)) for i in range(n)]
    sampling: dict = {"n": n, "skip_special_tokens": rng.random() < 0.5}
    if rng.random() < 0.5:
        sampling["logprobs"] = 1
    if rng.random() < 0.4:
        text = tokenizer.decode([t for m in outputs[0] for t in m.token_ids])
        if text:
            start = rng.randrange(len(text))
            sampling["stop"] = [text[start : start + rng.randint(1, 3)]]
    groups = _groups(rng, _interleaved(rng, outputs))

    per_message, one_pass = _stream(tokenizer, sampling), _stream(tokenizer, sampling)
    for group in groups:
        merged = _copy(group[0])
        for later in group[1:]:
            merge_engine_messages(merged, later)
        expected = per_message.process(merged)
        token_ids = [t for msg in group for t in msg.token_ids]
        got = one_pass.process_messages(group, token_ids)
        assert _wire(got) == _wire(expected), (seed, sampling)
    assert one_pass.finish_reasons == per_message.finish_reasons
    assert one_pass.num_sent_chars == per_message.num_sent_chars
    assert one_pass.num_tokens == per_message.num_tokens
    assert one_pass.finished and per_message.finished


class _PushedCall:
    """A call of the multiplexed hop as the reader sees it: it subscribes, and is pushed."""

    def subscribe(self, on_response, on_end) -> None:
        self.push, self.end = on_response, on_end


@pytest.mark.parametrize("interval", [1, 4, 16])
def test_the_reader_groups_by_output_and_interval(tokenizer, interval) -> None:
    rng = random.Random(interval)
    pieces = _pieces(tokenizer)
    outputs = [_output(rng, pieces, i, 40) for i in range(2)]
    messages = _interleaved(rng, outputs)

    async def run() -> tuple[list[WaitingOutput], int, int]:
        call = _PushedCall()
        num_arrived, num_taken = 0, 0

        def arrived() -> None:
            nonlocal num_arrived
            num_arrived += 1

        def taken(n: int) -> None:
            nonlocal num_taken
            num_taken += n

        reader = MergingReader(call, arrived, interval, taken)
        got: list[WaitingOutput] = []
        for start in range(0, len(messages), 5):  # an engine batch: 5 messages at once
            for msg in messages[start : start + 5]:
                call.push(msg)
            while True:  # the relay takes what is ripe, then waits for the next batch
                next_item = asyncio.ensure_future(reader.__anext__())
                await asyncio.sleep(0)
                if not next_item.done():
                    next_item.cancel()
                    break
                got.append(next_item.result())
        call.end(None)
        got += [waiting async for waiting in reader]
        return got, num_arrived, num_taken

    got, num_arrived, num_taken = asyncio.run(run())
    assert num_taken == len(messages)
    assert num_arrived == len(got)  # pushed: heard once per waiting output, not per message
    for index in (0, 1):
        mine = [w for w in got if w.messages[0].index == index]
        assert all(m.index == index for w in mine for m in w.messages)
        assert [t for w in mine for t in w.token_ids] == [
            t for m in outputs[index] for t in m.token_ids
        ]
        assert all(w.token_ids == [t for m in w.messages for t in m.token_ids] for w in mine)
        # The first is never held; the others go once `interval` tokens wait, or at the end.
        assert mine[0].messages[0] is outputs[index][0]
        assert all(len(w.token_ids) >= interval for w in mine[1:-1])
        assert mine[-1].messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        merged = mine[-1].merged()
        assert merged.usage.completion_tokens == 40
        assert list(merged.token_ids) == mine[-1].token_ids


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_inside_a_group_drops_the_rest_alike(tokenizer, include) -> None:
    """The tokens after the stop string's are dropped with their logprobs, and the
    cumulative logprob leaves them out, as for the merged message."""
    token_ids = tokenizer.encode(" a zz b c d e", add_special_tokens=False)
    messages = []
    total = 0.0
    for i, token_id in enumerate(token_ids):
        msg = engine_pb2.EngineGenerateResponse(
            request_id="req",
            token_ids=[token_id],
            usage=common_pb2.Usage(prompt_tokens=len(PROMPT), completion_tokens=i + 1),
        )
        total -= 0.25 * (i + 1)
        position = msg.logprobs.add()
        position.chosen.token_id, position.chosen.logprob = token_id, -0.25 * (i + 1)
        msg.cumulative_logprob = total
        messages.append(msg)
    sampling = {"stop": ["zz"], "logprobs": 0, "include_stop_str_in_output": include}
    merged = _copy(messages[0])
    for later in messages[1:]:
        merge_engine_messages(merged, later)
    expected = _stream(tokenizer, sampling).process(merged)
    got = _stream(tokenizer, sampling).process_messages(messages, list(token_ids))
    assert _wire(got) == _wire(expected)
    assert got.finish_reason == common_pb2.FINISH_REASON_STOP and got.stop_reason.text == "zz"
    assert len(got.token_ids) < len(token_ids) and len(got.logprobs) == len(got.token_ids)
    kept = len(got.token_ids)
    assert got.cumulative_logprob == pytest.approx(-0.25 * kept * (kept + 1) / 2)
