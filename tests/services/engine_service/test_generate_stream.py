"""The engine service's GenerateStream: many requests over one call, one batch per step.

Against Generate on the same server (the session's stack, real gRPC on loopback): the same
messages per request; fewer messages on the wire; a bad request ends only itself; an abort,
a deadline or the call's end aborts its requests in the engine (every KV block free again).
"""

from __future__ import annotations

import queue
import threading

import grpc
import pytest

from pagedserve.v1 import common_pb2, engine_pb2
from services.tokenizer_service.replicas.merging_reader import merge_engine_messages
from tests.services.helpers import token_prompts, wait_for

PROMPTS = token_prompts(8, seed=41)
LONG = dict(max_tokens=2000, ignore_eos=True)


def generate_request(
    request_id: str, prompt: list[int], **sampling
) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=common_pb2.SamplingParams(**sampling),
    )


def start(
    stream_id: int, request, timeout_s: float | None = None
) -> engine_pb2.EngineStreamRequest:
    message = engine_pb2.EngineStreamRequest(stream_id=stream_id, generate=request)
    if timeout_s is not None:
        message.timeout_s = timeout_s
    return message


def abort(stream_id: int) -> engine_pb2.EngineStreamRequest:
    return engine_pb2.EngineStreamRequest(stream_id=stream_id, abort=engine_pb2.EngineStreamAbort())


class StreamCall:
    """A GenerateStream call fed from a queue (None half-closes it); its batches are read
    by a thread into `responses` / `ends` per stream id."""

    def __init__(self, stack) -> None:
        self.sent: queue.Queue = queue.Queue()
        self.responses: dict[int, list[engine_pb2.EngineGenerateResponse]] = {}
        self.ends: dict[int, engine_pb2.EngineStreamEnd] = {}  # the last one per stream id
        self.all_ends: list[tuple[int, engine_pb2.EngineStreamEnd]] = []
        self.kinds: dict[int, list[str]] = {}  # per stream id, its entries' kinds in order
        self.num_batches = 0
        self.error: grpc.RpcError | None = None
        self.call = stack.engine_stub.GenerateStream(iter(self.sent.get, None), timeout=120)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.num_batches += 1
                for entry in batch.outputs:
                    self.kinds.setdefault(entry.stream_id, []).append(entry.WhichOneof("kind"))
                    if entry.WhichOneof("kind") == "end":
                        self.ends[entry.stream_id] = entry.end
                        self.all_ends.append((entry.stream_id, entry.end))
                    else:
                        self.responses.setdefault(entry.stream_id, []).append(entry.response)
        except grpc.RpcError as exc:
            self.error = exc

    def send(self, message) -> None:
        self.sent.put(message)

    def close(self) -> None:
        self.sent.put(None)
        self.reader.join(120)
        assert not self.reader.is_alive()


def per_request(stack, request) -> list[engine_pb2.EngineGenerateResponse]:
    return list(stack.engine_stub.Generate(request, timeout=60))


def by_index(responses) -> dict[int, bytes]:
    """Per output index, its messages merged into one (as bytes): the tokens, logprobs and
    the last message's finish and usage. A path whose reader falls behind gets an output's
    tokens in fewer, fuller messages (the engine sends all it has), so messages are compared
    by what they carry, not by how many there were."""
    merged: dict[int, engine_pb2.EngineGenerateResponse] = {}
    for r in responses:
        first = merged.get(r.index)
        if first is None:
            merged[r.index] = engine_pb2.EngineGenerateResponse.FromString(r.SerializeToString())
        else:
            merge_engine_messages(first, r)
    return {i: m.SerializeToString(deterministic=True) for i, m in merged.items()}


def test_same_messages_as_generate(stack) -> None:
    """One request at a time on both paths, each with its own cache salt: the same batches
    and no prefix-cache hits, so the engine's outputs are the same bits."""
    sampling = dict(max_tokens=12, ignore_eos=True, logprobs=2, n=2, temperature=1.0, seed=3)
    call = StreamCall(stack)
    for stream_id, prompt in enumerate(PROMPTS[:3]):
        request = generate_request(f"mux-eq-{stream_id}", prompt, **sampling)
        request.cache_salt = "per-request"
        expected = by_index(per_request(stack, request))
        request.cache_salt = "multiplexed"
        call.send(start(stream_id, request))
        wait_for(lambda sid=stream_id: sid in call.ends)
        assert call.ends[stream_id].code == 0
        assert by_index(call.responses[stream_id]) == expected, request.request_id
        merged = engine_pb2.EngineGenerateResponse.FromString(expected[0])
        assert len(merged.token_ids) == 12
        assert merged.finish_reason == common_pb2.FINISH_REASON_LENGTH
    call.close()
    assert call.error is None
    stack.wait_until_idle()


def test_one_message_per_step_for_all_streams(stack) -> None:
    requests = [
        generate_request(f"mux-many-{i}", p, max_tokens=16, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]
    call = StreamCall(stack)
    for stream_id, request in enumerate(requests):
        call.send(start(stream_id, request))
    call.close()
    assert call.error is None
    assert all(call.ends[i].code == 0 for i in range(len(requests))), call.ends
    for stream_id in range(len(requests)):
        responses = call.responses[stream_id]
        assert sum(len(r.token_ids) for r in responses) == 16
        assert responses[-1].usage.completion_tokens == 16
    # Generate would send one message per request per step; the call sends one per step.
    num_messages = sum(len(r) for r in call.responses.values())
    assert call.num_batches < num_messages
    stack.wait_until_idle()


def test_bad_request_ends_alone(stack) -> None:
    call = StreamCall(stack)
    call.send(start(1, generate_request("mux-good-1", PROMPTS[0], max_tokens=8, ignore_eos=True)))
    call.send(start(2, generate_request("mux-bad", PROMPTS[1], top_p=2.0)))
    call.send(start(3, generate_request("", PROMPTS[2], max_tokens=4)))
    call.send(start(4, generate_request("mux-good-2", PROMPTS[3], max_tokens=8, ignore_eos=True)))
    call.send(start(4, generate_request("mux-dup", PROMPTS[3], max_tokens=8)))
    call.send(start(5, generate_request("mux-nan", PROMPTS[3], max_tokens=8), float("nan")))
    call.close()
    assert call.error is None
    assert call.ends[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "sampling_params.top_p" in call.ends[2].message
    assert call.ends[3].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "request_id" in call.ends[3].message
    (duplicate,) = [end for sid, end in call.all_ends if sid == 4 and end.code != 0]
    assert duplicate.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "stream_id 4 is already in use" in duplicate.message
    assert call.ends[5].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "timeout_s" in call.ends[5].message
    assert not {2, 3, 5} & call.responses.keys()
    for good in (1, 4):
        assert call.ends[good].code == 0
        assert sum(len(r.token_ids) for r in call.responses[good]) == 8
    stack.wait_until_idle()


def test_abort_message_frees_the_request(stack) -> None:
    total = stack.stats().num_total_blocks
    call = StreamCall(stack)
    call.send(start(7, generate_request("mux-abort", PROMPTS[4], **LONG)))
    call.send(start(8, generate_request("mux-abort-other", PROMPTS[5], max_tokens=6)))
    wait_for(lambda: call.responses.get(7))
    call.send(abort(7))
    wait_for(lambda: stack.stats().num_requests == 0 and stack.stats().num_free_blocks == total)
    call.close()  # the call itself goes on and ends OK
    assert call.error is None
    assert 7 not in call.ends and call.ends[8].code == 0
    assert sum(len(r.token_ids) for r in call.responses[7]) < LONG["max_tokens"]


def test_deadline_ends_the_request(stack) -> None:
    call = StreamCall(stack)
    call.send(start(1, generate_request("mux-deadline", PROMPTS[6], **LONG), timeout_s=0.5))
    wait_for(lambda: 1 in call.ends)
    assert call.ends[1].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    call.close()
    stack.wait_until_idle()


@pytest.mark.parametrize("how", ["cancel", "half_close_then_cancel"])
def test_call_end_aborts_every_request(stack, how) -> None:
    call = StreamCall(stack)
    for i in range(3):
        call.send(start(i, generate_request(f"mux-cancel-{how}-{i}", PROMPTS[i], **LONG)))
    wait_for(lambda: len(call.responses) == 3)
    if how == "half_close_then_cancel":
        call.sent.put(None)  # the requests run on after a half-close ...
    call.call.cancel()  # ... until the call ends
    call.reader.join(60)
    assert call.error is not None and call.error.code() == grpc.StatusCode.CANCELLED
    stack.wait_until_idle()


def test_requests_finishing_among_many(stack) -> None:
    """Requests of different lengths on one call, in the same steps: each gets its own
    tokens, its finish reason and usage on its last message, then its end, and nothing
    after; the ones still running are not disturbed."""
    lengths = [2, 9, 5, 14, 3, 9]
    call = StreamCall(stack)
    for stream_id, n in enumerate(lengths):
        request = generate_request(f"mux-mid-{stream_id}", PROMPTS[stream_id], max_tokens=n)
        request.sampling_params.ignore_eos = True
        call.send(start(stream_id, request))
    call.close()
    assert call.error is None
    for stream_id, n in enumerate(lengths):
        responses = call.responses[stream_id]
        assert call.ends[stream_id].code == 0
        assert call.kinds[stream_id] == ["response"] * len(responses) + ["end"]
        assert sum(len(r.token_ids) for r in responses) == n
        assert [r.finish_reason for r in responses[:-1]] == [0] * (len(responses) - 1)
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == n
        assert responses[-1].usage.prompt_tokens == len(PROMPTS[stream_id])
    stack.wait_until_idle()


def test_abort_among_many(stack) -> None:
    """One request aborted while others share its steps: it sends nothing more (no finish,
    no end), its blocks are freed, and the others finish whole."""
    call = StreamCall(stack)
    call.send(start(0, generate_request("mux-abort-mid", PROMPTS[0], **LONG)))
    for stream_id in (1, 2, 3):
        request = generate_request(f"mux-abort-peer-{stream_id}", PROMPTS[stream_id], **LONG)
        request.sampling_params.max_tokens = 40
        call.send(start(stream_id, request))
    wait_for(lambda: all(call.responses.get(i) for i in range(4)))
    call.send(abort(0))
    call.close()
    assert call.error is None
    assert 0 not in call.ends
    assert all(r.finish_reason == 0 for r in call.responses[0])
    for stream_id in (1, 2, 3):
        assert call.ends[stream_id].code == 0
        assert sum(len(r.token_ids) for r in call.responses[stream_id]) == 40
    stack.wait_until_idle()
    stats = stack.stats()
    assert stats.num_requests == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_an_aborted_request_id_is_free_for_the_next_start_on_the_call(stack) -> None:
    """A caller that aborts a request (its client's stop string) and starts one with the same
    request_id right after, on the same call, gets the new request served: the engine
    service takes the start in only once the aborted request has left (the messages of one
    call are ordered; the abort frees the id asynchronously)."""
    call = StreamCall(stack)
    rounds = 5
    for i in range(rounds):
        call.send(start(2 * i, generate_request("mux-reused", PROMPTS[7], **LONG)))
        wait_for(lambda i=i: call.responses.get(2 * i))
        call.send(abort(2 * i))
        call.send(start(2 * i + 1, generate_request("mux-reused", PROMPTS[7], max_tokens=3)))
        wait_for(lambda i=i: 2 * i + 1 in call.ends)
        assert call.ends[2 * i + 1].code == 0, call.ends[2 * i + 1].message
        assert sum(len(r.token_ids) for r in call.responses[2 * i + 1]) == 3
    call.close()
    assert call.error is None
    stack.wait_until_idle()
