"""Generate through both services gives what offline `LLM.generate` gives, token for token."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from pagedserve.v1 import common_pb2, generation_pb2
from tests.services.helpers import StreamedOutput, gather, request, token_prompts

FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH}


def assert_matches(streamed: StreamedOutput, expected) -> None:
    assert streamed.token_ids == expected.token_ids
    assert streamed.text == expected.text
    assert streamed.finish_reason == FINISH[expected.finish_reason]
    if isinstance(expected.stop_reason, str):
        assert streamed.stop_reason.text == expected.stop_reason
    elif isinstance(expected.stop_reason, int):
        assert streamed.stop_reason.token_id == expected.stop_reason
    else:
        assert streamed.stop_reason is None
    assert streamed.usage.completion_tokens == len(expected.token_ids)


def offline(llm, prompt, **params):
    prompt = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def test_greedy_streams_match_offline(stack, offline_llm):
    prompts = token_prompts(4, seed=1)
    expected = offline_llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=24),
        use_tqdm=False,
    )
    for prompt, exp in zip(prompts, expected):
        req = request(token_ids=prompt, temperature=0, max_tokens=24)
        outputs = gather(stack.public.Generate(req, timeout=60))
        assert list(outputs) == [0]
        assert_matches(outputs[0], exp.outputs[0])
        assert outputs[0].num_messages > 1  # streamed, not sent at the end
        assert outputs[0].usage.prompt_tokens == len(prompt)


def test_text_and_chat_inputs_match_offline(stack, offline_llm):
    text = "The capital of France is"
    outputs = gather(stack.public.Generate(request(text=text, temperature=0, max_tokens=12)))
    assert_matches(outputs[0], offline(offline_llm, text, temperature=0, max_tokens=12).outputs[0])

    messages = [{"role": "user", "content": "Name three colours."}]
    chat = generation_pb2.GenerateRequest(
        chat=generation_pb2.ChatInput(messages=[generation_pb2.ChatMessage(**messages[0])]),
        sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=12),
    )
    expected = offline_llm.chat(
        messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )[0]
    assert_matches(gather(stack.public.Generate(chat))[0], expected.outputs[0])


def test_n_seeded_samples_match_offline(stack, offline_llm):
    prompt = token_prompts(1, seed=2)[0]
    params = {"n": 3, "temperature": 0.9, "seed": 1234, "max_tokens": 16}
    expected = offline(offline_llm, prompt, **params)
    outputs = gather(stack.public.Generate(request(token_ids=prompt, **params)))
    assert sorted(outputs) == [0, 1, 2]
    for index, exp in enumerate(expected.outputs):
        assert_matches(outputs[index], exp)
    assert len({tuple(o.token_ids) for o in outputs.values()}) > 1  # real samples


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_strings_match_offline(stack, offline_llm, include_stop):
    prompt = token_prompts(1, seed=3)[0]
    full = offline(offline_llm, prompt, temperature=0, max_tokens=32).outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # a string the answer does contain
    params = {
        "temperature": 0,
        "max_tokens": 32,
        "stop": [stop],
        "include_stop_str_in_output": include_stop,
    }
    expected = offline(offline_llm, prompt, **params).outputs[0]
    assert expected.stop_reason == stop
    streamed = gather(stack.public.Generate(request(token_ids=prompt, **params)))[0]
    assert_matches(streamed, expected)
    assert streamed.text.endswith(stop) == include_stop
    stack.wait_until_idle()  # the engine request was aborted once the stop string matched


def test_stop_token_ids_match_offline(stack, offline_llm):
    prompt = token_prompts(1, seed=4)[0]
    tokens = offline(offline_llm, prompt, temperature=0, max_tokens=20).outputs[0].token_ids
    stop_id = next(t for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i])
    params = {"temperature": 0, "max_tokens": 20, "stop_token_ids": [stop_id]}
    expected = offline(offline_llm, prompt, **params).outputs[0]
    assert expected.stop_reason == stop_id
    assert_matches(gather(stack.public.Generate(request(token_ids=prompt, **params)))[0], expected)


def test_logprobs_match_offline(stack, offline_llm):
    prompt = token_prompts(1, seed=5)[0]
    params = {"temperature": 0, "max_tokens": 8, "logprobs": 3, "prompt_logprobs": 2}
    expected = offline(offline_llm, prompt, **params)
    responses = list(stack.public.Generate(request(token_ids=prompt, **params)))
    streamed = gather(responses)[0]
    assert_matches(streamed, expected.outputs[0])
    decode = offline_llm.get_tokenizer().decode
    assert len(streamed.logprobs) == len(streamed.token_ids)
    for token_id, position, exp in zip(
        streamed.token_ids, streamed.logprobs, expected.outputs[0].logprobs
    ):
        assert position.chosen.token_id == token_id
        assert position.chosen.logprob == pytest.approx(exp[token_id].logprob, abs=1e-5)
        assert position.chosen.text == decode([token_id])
        assert [e.rank for e in position.top] == [1, 2, 3]
        assert [e.logprob for e in position.top] == sorted(
            (e.logprob for e in position.top), reverse=True
        )
        assert all(e.text == decode([e.token_id]) for e in position.top)
    prompt_logprobs = responses[0].prompt_logprobs
    assert len(prompt_logprobs) == len(prompt)
    assert not prompt_logprobs[0].HasField("chosen")  # nothing predicts the first token
    assert [p.chosen.token_id for p in prompt_logprobs[1:]] == prompt[1:]
    assert all(not r.prompt_logprobs for r in responses[1:])
    cumulative = responses[-1].cumulative_logprob
    assert cumulative == pytest.approx(sum(p.chosen.logprob for p in streamed.logprobs), abs=1e-4)
