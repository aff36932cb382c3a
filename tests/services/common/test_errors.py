"""Bad requests get their status code and a message naming the field; others carry on."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from engine import EngineDeadError
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.common.errors import status_for
from tests.services.helpers import gather, request, token_prompts, wait_for

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PROMPT = [100, 200, 300]


def _chat(*roles: str) -> generation_pb2.GenerateRequest:
    messages = [generation_pb2.ChatMessage(role=r, content="hi") for r in roles]
    return generation_pb2.GenerateRequest(chat=generation_pb2.ChatInput(messages=messages))


BAD_REQUESTS = {
    "no input": (generation_pb2.GenerateRequest(), INVALID, "input"),
    "empty text": (request(text=""), INVALID, "text"),
    "empty token_ids": (request(token_ids=[]), INVALID, "token_ids"),
    "prompt over max_model_len": (request(token_ids=[5] * 5000), INVALID, "max_model_len"),
    "temperature < 0": (request(token_ids=PROMPT, temperature=-0.5), INVALID, "temperature"),
    "top_p 0": (request(token_ids=PROMPT, top_p=0.0), INVALID, "sampling_params.top_p"),
    "top_p 0 greedy": (request(token_ids=PROMPT, top_p=0.0, temperature=0), INVALID, "top_p"),
    "top_p > 1": (request(token_ids=PROMPT, top_p=1.5), INVALID, "sampling_params.top_p"),
    "n 0": (request(token_ids=PROMPT, n=0), INVALID, "sampling_params.n"),
    "max_tokens 0": (request(token_ids=PROMPT, max_tokens=0), INVALID, "max_tokens"),
    "unknown token id": (request(token_ids=[1, 49152]), INVALID, "prompt_token_ids[1] = 49152"),
    "unknown stop token id": (
        request(token_ids=PROMPT, stop_token_ids=[10**6]),
        INVALID,
        "sampling_params.stop_token_ids[0]",
    ),
    "logprobs over max_logprobs": (
        request(token_ids=PROMPT, logprobs=50),
        INVALID,
        "sampling_params.logprobs=50 exceeds max_logprobs=20",
    ),
    "prompt_logprobs over max_logprobs": (
        request(token_ids=PROMPT, prompt_logprobs=21),
        INVALID,
        "sampling_params.prompt_logprobs=21 exceeds max_logprobs=20",
    ),
    # vLLM's SamplingParams._verify_args, one entry per rule the wire can carry (the rest:
    # tests/engine/test_sampling_params_checks.py). Stop strings are the tokenizer
    # service's own (they never reach the engine).
    "empty stop string": (request(token_ids=PROMPT, stop=[""]), INVALID, "sampling_params.stop[0]"),
    "empty stop string among others": (
        request(token_ids=PROMPT, stop=["ok", ""]),
        INVALID,
        "sampling_params.stop[1]: stop cannot contain an empty string",
    ),
    "presence_penalty > 2": (
        request(token_ids=PROMPT, presence_penalty=2.5),
        INVALID,
        "sampling_params.presence_penalty",
    ),
    "frequency_penalty < -2": (
        request(token_ids=PROMPT, frequency_penalty=-2.5),
        INVALID,
        "sampling_params.frequency_penalty",
    ),
    "repetition_penalty 0": (
        request(token_ids=PROMPT, repetition_penalty=0.0),
        INVALID,
        "sampling_params.repetition_penalty",
    ),
    "repetition_penalty inf": (
        request(token_ids=PROMPT, repetition_penalty=float("inf")),
        INVALID,
        "sampling_params.repetition_penalty",
    ),
    "temperature inf": (
        request(token_ids=PROMPT, temperature=float("inf")),
        INVALID,
        "sampling_params.temperature",
    ),
    "temperature nan": (
        request(token_ids=PROMPT, temperature=float("nan")),
        INVALID,
        "sampling_params.temperature",
    ),
    "temperature > 2": (
        request(token_ids=PROMPT, temperature=2.5),
        INVALID,
        "sampling_params.temperature",
    ),
    "top_k < -1": (request(token_ids=PROMPT, top_k=-2), INVALID, "sampling_params.top_k"),
    "min_p > 1": (request(token_ids=PROMPT, min_p=1.5), INVALID, "sampling_params.min_p"),
    "min_tokens > max_tokens": (
        request(token_ids=PROMPT, min_tokens=8, max_tokens=4),
        INVALID,
        "sampling_params.min_tokens",
    ),
    # What one request may cost (services/tokenizer_service/request_limits.py).
    "n over max_n": (request(token_ids=PROMPT, n=3000), INVALID, "sampling_params.n=3000"),
    "n near 2**32": (request(token_ids=PROMPT, n=4_000_000_000), INVALID, "max_n=16"),
    "max_tokens over max_model_len": (
        request(token_ids=PROMPT, max_tokens=2**32 - 1),
        INVALID,
        "sampling_params.max_tokens=4294967295 exceeds the model's length max_model_len=4096",
    ),
    "20,000 stop strings": (
        request(token_ids=PROMPT, stop=[f"s{i}" for i in range(20_000)]),
        INVALID,
        "sampling_params.stop: 20000 stop strings, more than the limit max_stop_strings=64",
    ),
    "long stop string": (
        request(token_ids=PROMPT, stop=["ok", "x" * 2000]),
        INVALID,
        "sampling_params.stop[1]",
    ),
    "text over max_prompt_bytes": (
        request(text="é" * (600 * 1024)),
        INVALID,
        "text: 1228800 bytes, more than the limit max_prompt_bytes=1048576",
    ),
    "chat over max_chat_messages": (
        _chat(*(["user", "assistant"] * 600)),
        INVALID,
        "chat.messages: 1200 messages, more than the limit max_chat_messages=1024",
    ),
    "no chat messages": (_chat(), INVALID, "chat.messages"),
    "empty chat role": (_chat("user", ""), INVALID, "chat.messages[1].role"),
    "unknown chat role": (_chat("bot"), INVALID, "chat.messages[0].role"),
}


def _status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    return info.value.code(), info.value.details()


def test_bad_requests_are_rejected_while_others_stream(stack, offline_llm):
    # A long request streams the whole time; bad ones must not disturb it.
    long_req = request(token_ids=token_prompts(1, seed=20)[0], temperature=0, max_tokens=200)
    long_result: dict = {}
    long_thread = threading.Thread(
        target=lambda: long_result.update(gather(stack.public.Generate(long_req, timeout=120)))
    )
    long_thread.start()
    for name, (bad, code, field) in BAD_REQUESTS.items():
        got_code, details = _status(stack.public.Generate(bad, timeout=30))
        assert got_code == code, f"{name}: {got_code} {details}"
        assert field in details, f"{name}: {details!r}"
    long_thread.join(120)
    assert long_result[0].finish_reason in (
        common_pb2.FINISH_REASON_LENGTH,
        common_pb2.FINISH_REASON_STOP,
    )
    assert long_result[0].usage.completion_tokens == len(long_result[0].token_ids)
    stack.wait_until_idle()


def test_duplicate_request_id_is_already_exists(stack):
    first = stack.public.Generate(
        request(token_ids=PROMPT, request_id="dup", max_tokens=400, ignore_eos=True), timeout=60
    )
    next(first)  # the first request is live
    code, details = _status(stack.public.Generate(request(token_ids=PROMPT, request_id="dup")))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    assert "dup" in details and "request_id" in details
    first.cancel()
    stack.wait_until_idle()


def test_deadline_exceeded_aborts_the_engine_request(stack):
    req = request(token_ids=PROMPT, max_tokens=500, ignore_eos=True)
    code, _ = _status(stack.public.Generate(req, timeout=0.3))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    stack.wait_until_idle()


def test_limits_of_a_small_server(stack):
    """max_inflight_requests → RESOURCE_EXHAUSTED; max_prompt_tokens → INVALID_ARGUMENT."""
    server = stack.start_tokenizer_server(max_inflight_requests=1, max_prompt_tokens=8)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = generation_pb2_grpc.TextGenerationServiceStub(channel)
            code, details = _status(stub.Generate(request(token_ids=list(range(3, 12)))))
            assert code == INVALID and "max_prompt_tokens" in details
            first = stub.Generate(request(token_ids=PROMPT, max_tokens=400, ignore_eos=True))
            next(first)
            code, details = _status(stub.Generate(request(token_ids=PROMPT)))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_inflight_requests" in details
            first.cancel()
            wait_for(lambda: len(server.servicer.requests) == 0)
            assert gather(stub.Generate(request(token_ids=PROMPT, max_tokens=4)))[0].token_ids
    finally:
        stack.loop.run(server.stop(0))
    stack.wait_until_idle()


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ValueError("temperature must be >= 0"), INVALID),
        (TypeError("prompt_token_ids must be a list of ints."), INVALID),
        (ValueError("request_id 'a' is already in use by a live request."), "ALREADY_EXISTS"),
        (ValueError("... blocks: it could never be scheduled."), "RESOURCE_EXHAUSTED"),
        (NotImplementedError("lora_request"), "UNIMPLEMENTED"),
        (EngineDeadError("The engine loop died"), "UNAVAILABLE"),
        (asyncio.CancelledError(), "CANCELLED"),
        (TimeoutError(), "DEADLINE_EXCEEDED"),
        (RuntimeError("bug"), "INTERNAL"),
    ],
)
def test_exception_to_status_code(exc, code):
    expected = code if isinstance(code, grpc.StatusCode) else grpc.StatusCode[code]
    assert status_for(exc)[0] == expected
