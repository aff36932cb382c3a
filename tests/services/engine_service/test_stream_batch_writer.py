"""GenerateStream's outgoing side without a server: the entries a batch builds from
`EngineResponseBuilder.fields` are the messages `build` gives a Generate call, byte for
byte, for every field; and the batch writer ends on `close` even when the last entries
came while a write was waiting on flow control."""

from __future__ import annotations

import asyncio

import grpc

from engine import Logprob, RequestOutput, SamplingParams
from engine.api.outputs import CompletionOutput
from pagedserve.v1 import engine_pb2
from services.engine_service.convert import EngineResponseBuilder
from services.engine_service.stream_servicer import StreamBatchWriter


def _output(step: int, finished: bool) -> RequestOutput:
    """A step of an n = 2 request with logprobs and prompt logprobs; index 1 ends on a stop
    string at step 1, index 0 on a stop token at the last step."""

    def completion(index: int, finish: str | None, stop: int | str | None) -> CompletionOutput:
        token = 10 * step + index
        return CompletionOutput(
            index=index,
            text="",
            token_ids=[token],
            cumulative_logprob=-0.5 * (step + 1),
            logprobs=[{token: Logprob(-0.5, 2), 7: Logprob(-0.25, 1)}],
            finish_reason=finish,
            stop_reason=stop,
        )

    outputs = [completion(0, "stop" if finished else None, 2 if finished else None)]
    if step <= 1:
        outputs.append(completion(1, "stop" if step == 1 else None, "END" if step == 1 else None))
    return RequestOutput(
        request_id="req-7",
        prompt=None,
        prompt_token_ids=[5, 6, 7],
        prompt_logprobs=[None, {6: Logprob(-1.0, 1)}, {7: Logprob(-2.0, 3)}] if step == 0 else None,
        outputs=outputs,
        finished=finished,
        num_cached_tokens=16 if step else 0,
    )


def test_batch_entries_equal_generate_messages() -> None:
    params = SamplingParams(n=2, logprobs=1, prompt_logprobs=1, max_tokens=8)
    resumed = {0: [1, 2, 3]}  # usage counts a resumed output's tokens so far
    standalone = EngineResponseBuilder("req-7", params, resumed)
    batched = EngineResponseBuilder("req-7", params, resumed)
    expected, batch = [], engine_pb2.EngineStreamBatch()
    steps = [_output(step, finished=step == 3) for step in range(4)]
    for output in steps:
        expected += [m.SerializeToString() for m in standalone.build(output)]
        for fields in batched.fields(output):
            batch.outputs.add(stream_id=4, response=fields)
    got = [entry.response.SerializeToString() for entry in batch.outputs]
    assert got == expected
    first = batch.outputs[0].response
    assert len(first.prompt_logprobs) == 3 and first.usage.completion_tokens == 4
    last = batch.outputs[-1].response
    assert last.finish_reason != 0 and last.stop_reason.token_id == 2
    assert last.usage.completion_tokens == 3 + 4 and last.usage.cached_tokens == 16
    assert standalone.finish_reasons == batched.finish_reasons == {0: "stop", 1: "stop"}


class _FlowControlledCall:
    """The writer's view of a call: `write` waits until the test lets it through."""

    def __init__(self) -> None:
        self.batches: list[engine_pb2.EngineStreamBatch] = []
        self.writing = asyncio.Event()
        self.go = asyncio.Event()

    async def write(self, batch: engine_pb2.EngineStreamBatch) -> None:
        self.writing.set()
        await self.go.wait()
        self.batches.append(batch)


def test_writer_ends_when_closed_during_a_write() -> None:
    async def main() -> None:
        call = _FlowControlledCall()
        writer = StreamBatchWriter(call)
        running = asyncio.ensure_future(writer.run())
        writer.add_fields(1, {"request_id": "a", "token_ids": [3]})
        await asyncio.wait_for(call.writing.wait(), 30)
        # While the write waits: the request ends and the call closes.
        writer.end(1, grpc.StatusCode.OK, "")
        writer.close()
        await asyncio.sleep(0)
        call.go.set()
        await asyncio.wait_for(running, 30)
        kinds = [[e.WhichOneof("kind") for e in b.outputs] for b in call.batches]
        assert kinds == [["response"], ["end"]]
        assert writer.num_batches == 2

    asyncio.run(main())


def _merged(messages: list[engine_pb2.EngineGenerateResponse]) -> dict[int, bytes]:
    """Each output's messages as the tokenizer service merges them (merging_reader.py)."""
    from services.tokenizer_service.replicas.merging_reader import merge_engine_messages

    merged: dict[int, engine_pb2.EngineGenerateResponse] = {}
    for message in messages:
        if message.index in merged:
            merge_engine_messages(merged[message.index], message)
        else:
            merged[message.index] = engine_pb2.EngineGenerateResponse()
            merged[message.index].CopyFrom(message)
    return {i: m.SerializeToString(deterministic=True) for i, m in merged.items()}


def _single(step: int, finished: bool) -> RequestOutput:
    """A step of an n = 1 request with logprobs, prompt logprobs on the first."""
    output = _output(step, finished)
    output.outputs = output.outputs[:1]
    return output


def test_steps_that_wait_for_a_write_join_their_output_entry() -> None:
    """Several steps added before a write (the reader behind): an n = 1 request has one
    entry carrying them all, equal to its Generate messages merged; with n = 2 the entries
    stay in order and merge to the same; a later end or write starts a new entry."""
    writer = StreamBatchWriter(None)
    params = SamplingParams(n=1, logprobs=1, prompt_logprobs=1, max_tokens=8)
    standalone = EngineResponseBuilder("req-7", params, {0: [1, 2]})
    batched = EngineResponseBuilder("req-7", params, {0: [1, 2]})
    expected: list[engine_pb2.EngineGenerateResponse] = []
    for step in range(4):
        output = _single(step, finished=step == 3)
        expected += standalone.build(output)
        for fields in batched.fields(output):
            writer.add_fields(3, fields)
    writer.add_fields(9, {"index": 0, "token_ids": [5], "usage": {}})  # another stream
    writer.end(3, grpc.StatusCode.OK, "")
    entries = list(writer._batch.outputs)
    assert [(e.stream_id, e.WhichOneof("kind")) for e in entries] == [
        (3, "response"),
        (9, "response"),
        (3, "end"),
    ]
    first = entries[0].response
    assert list(first.token_ids) == [0, 10, 20, 30] and len(first.logprobs) == 4
    assert first.usage.completion_tokens == 2 + 4 and first.finish_reason != 0
    assert _merged([first]) == _merged(expected)

    # n = 2: the outputs' entries interleave, so none is appended to; each output's
    # entries merge to what Generate's messages merge to.
    writer = StreamBatchWriter(None)
    params = SamplingParams(n=2, logprobs=1, prompt_logprobs=1, max_tokens=8)
    standalone = EngineResponseBuilder("req-7", params)
    batched = EngineResponseBuilder("req-7", params)
    expected = []
    for step in range(4):
        output = _output(step, finished=step == 3)
        expected += standalone.build(output)
        for fields in batched.fields(output):
            writer.add_fields(3, fields)
    responses = [e.response for e in writer._batch.outputs]
    assert [r.index for r in responses] == [m.index for m in expected][: len(responses)]
    assert _merged(responses) == _merged(expected)


def test_an_entry_written_is_not_appended_to() -> None:
    async def main() -> None:
        call = _FlowControlledCall()
        writer = StreamBatchWriter(call)
        running = asyncio.ensure_future(writer.run())
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0}
        writer.add_fields(1, {"index": 0, "token_ids": [3], "usage": usage})
        await asyncio.wait_for(call.writing.wait(), 30)
        # While the first batch is being written: two steps, one entry in the next batch.
        writer.add_fields(1, {"index": 0, "token_ids": [4], "usage": usage})
        writer.add_fields(1, {"index": 0, "token_ids": [5], "usage": usage})
        writer.close()
        call.go.set()
        await asyncio.wait_for(running, 30)
        tokens = [[list(e.response.token_ids) for e in b.outputs] for b in call.batches]
        assert tokens == [[[3]], [[4, 5]]]

    asyncio.run(main())
