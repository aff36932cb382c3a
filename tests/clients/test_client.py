"""`Client` against real in-process services (tiny model): streams, whole results, the text
RPCs, health, deadlines, typed errors, and cancellation that frees the engine."""

from __future__ import annotations

import threading

import pytest

from clients import (
    Client,
    DeadlineExceededError,
    GenerationDelta,
    InvalidArgumentError,
    PagedServeError,
)
from clients.outputs import ResultBuilder
from tests.services.helpers import token_prompts, wait_for

PROMPT = token_prompts(1, seed=30)[0]


@pytest.fixture(scope="module")
def client(address):
    with Client(address, timeout=60) as client:
        yield client


def test_streamed_deltas_add_up_to_generate_text(client):
    deltas = list(client.generate("The capital of France is", temperature=0, max_tokens=12))
    assert all(isinstance(d, GenerationDelta) for d in deltas)
    assert len(deltas) > 1  # streamed, not sent at the end
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    result = client.generate_text("The capital of France is", temperature=0, max_tokens=12)
    assert "".join(d.text for d in deltas) == result.text
    assert [t for d in deltas for t in d.token_ids] == result.outputs[0].token_ids
    assert result.finish_reasons == [deltas[-1].finish_reason] == ["length"]
    assert result.usage.completion_tokens == 12
    assert result.usage.prompt_tokens == deltas[-1].usage.prompt_tokens > 0
    assert result.request_id.startswith("gen-")  # made by the server


def test_n_outputs_logprobs_and_stop_token(client):
    greedy = client.generate_text(token_ids=PROMPT, temperature=0, max_tokens=8)
    stop_id = greedy.outputs[0].token_ids[3]
    stopped = client.generate_text(
        token_ids=PROMPT, temperature=0, max_tokens=8, stop_token_ids=[stop_id], logprobs=2
    )
    first = greedy.outputs[0].token_ids.index(stop_id)
    assert stopped.outputs[0].token_ids == greedy.outputs[0].token_ids[: first + 1]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", stop_id)
    positions = stopped.outputs[0].logprobs
    assert [p.chosen.token_id for p in positions] == stopped.outputs[0].token_ids
    assert all(len(p.top) == 2 and p.top[0].rank == 1 for p in positions)

    sampled = client.generate_text(
        token_ids=PROMPT, n=3, temperature=1.0, seed=7, max_tokens=6, request_id="client-n"
    )
    assert sampled.request_id == "client-n"
    assert [o.index for o in sampled.outputs] == [0, 1, 2]
    assert all(len(ids) == 6 for ids in sampled.token_ids)
    assert sampled.usage.completion_tokens == 18


def test_chat_uses_the_chat_template(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    answer = client.chat(messages, temperature=0, max_tokens=8)
    rendered = client.tokenize(messages=messages)
    assert answer.usage.prompt_tokens == rendered.count
    streamed = ResultBuilder().add_all(
        client.generate(messages=messages, temperature=0, max_tokens=8)
    )
    assert streamed.result().text == answer.text


def test_text_rpcs_model_info_and_health(client):
    tokens = client.tokenize("Hello world")
    assert tokens.tokens == ["Hello", "Ġworld"] and tokens.count == 2
    assert tokens.max_model_len == 512
    assert client.detokenize(tokens.token_ids) == "Hello world"

    info = client.model_info()
    assert (info.vocab_size, info.max_model_len, info.hidden_size) == (49152, 512, 64)
    assert info.eos_token_ids == [2] and info.architecture == "LlamaForCausalLM"

    embeddings = client.encode(["Hello world", "The capital of France is"])
    assert [len(e) for e in embeddings] == [64, 64]
    assert sum(v * v for v in embeddings[0]) == pytest.approx(1.0, abs=1e-4)  # normalised
    # Alone rather than batched with a second input: equal up to fp32 GEMM rounding.
    alone = client.encode(token_ids=[tokens.token_ids])[0]
    assert alone == pytest.approx(embeddings[0], abs=1e-5)

    health = client.health()
    assert health.healthy and health.status == "SERVING"
    assert health.details["engine_reachable"] == "true"


def test_bad_input_raises_invalid_argument_naming_the_field(client):
    with pytest.raises(InvalidArgumentError) as info:
        client.generate_text(token_ids=PROMPT, top_p=0.0)
    assert "sampling_params.top_p" in info.value.message
    assert info.value.code.name == "INVALID_ARGUMENT"
    # The engine checks prompt token ids (one rule, one place), naming its field.
    with pytest.raises(InvalidArgumentError, match=r"prompt_token_ids\[1\] = 1000000"):
        client.generate_text(token_ids=[5, 10**6])
    with pytest.raises(InvalidArgumentError, match=r"chat\.messages\[0\]\.role"):
        client.chat([{"role": "bot", "content": "hi"}])
    with pytest.raises(InvalidArgumentError, match="max_tokens"):  # caught before sending
        client.generate_text(token_ids=PROMPT, max_tokens=-1)
    with pytest.raises(ValueError):  # an InvalidArgumentError is a ValueError too
        client.detokenize([10**6])
    with pytest.raises(TypeError, match="max_token"):
        client.generate_text(token_ids=PROMPT, max_token=3)
    with pytest.raises(InvalidArgumentError, match=r"pooling_params\.dimensions must be"):
        client.encode(token_ids=[PROMPT], dimensions=0)
    with pytest.raises(InvalidArgumentError, match="does not support Matryoshka"):
        client.encode(token_ids=[PROMPT], dimensions=32)  # the tiny model declares none


def test_deadline_raises_and_aborts_the_request(client, stack):
    with pytest.raises(DeadlineExceededError) as info:
        client.generate_text(token_ids=PROMPT, max_tokens=480, ignore_eos=True, timeout=0.3)
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, PagedServeError)
    stack.wait_until_idle()


def _generated_tokens(stack) -> int:
    return stack.stats().num_generation_tokens_total


def test_leaving_the_loop_aborts_the_request_server_side(client, stack):
    stack.wait_until_idle()
    before = _generated_tokens(stack)
    for delta in client.generate(token_ids=PROMPT, max_tokens=480, ignore_eos=True):
        assert delta.token_ids
        break  # the stream is dropped: its call is cancelled
    stack.wait_until_idle()
    assert _generated_tokens(stack) - before < 480  # stopped early, not run to the end
    wait_for(lambda: len(stack.tokenizer_server.servicer.requests) == 0)

    with client.generate(token_ids=PROMPT, max_tokens=480, ignore_eos=True) as stream:
        first = next(stream)
    assert list(stream) == []  # a cancelled stream just ends
    stack.wait_until_idle()
    assert first.request_id == stream.request_id


def test_abort_by_request_id_ends_the_stream(client, stack):
    stream = client.generate(
        token_ids=PROMPT, max_tokens=480, ignore_eos=True, request_id="client-abort"
    )
    first = next(stream)
    aborted: list[str] = []
    thread = threading.Thread(target=lambda: aborted.extend(client.abort("client-abort")))
    thread.start()
    rest = list(stream)
    thread.join(10)
    assert aborted == ["client-abort"]
    assert rest[-1].finish_reason == "abort"
    assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) < 480
    assert client.abort(["client-abort", "nope"]) == []
    stack.wait_until_idle()
