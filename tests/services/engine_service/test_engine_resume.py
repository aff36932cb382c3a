"""The engine service's Generate with `resumed_output_token_ids` (the tokenizer service's
migration path): a stream cut after k tokens and resumed over gRPC goes on with the tokens
the uninterrupted stream had, usage counts the whole output, and bad resumed tokens are
INVALID_ARGUMENT naming the field. Real gRPC servers on loopback (the session's stack)."""

from __future__ import annotations

import grpc
import pytest

from pagedserve.v1 import common_pb2, engine_pb2

PROMPT = [3 + (11 * i) % 200 for i in range(12)]


def generate(stack, request_id: str, sampling: dict, resumed=None):
    """{index: token ids}, {index: last usage.completion_tokens}, {index: finish reason}."""
    request = engine_pb2.EngineGenerateRequest(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        sampling_params=common_pb2.SamplingParams(**sampling),
    )
    for index, token_ids in (resumed or {}).items():
        request.resumed_output_token_ids[index].ids.extend(token_ids)
    tokens: dict[int, list[int]] = {}
    usage: dict[int, int] = {}
    finish: dict[int, int] = {}
    for response in stack.engine_stub.Generate(request, timeout=60):
        tokens.setdefault(response.index, []).extend(response.token_ids)
        usage[response.index] = response.usage.completion_tokens
        if response.finish_reason:
            finish[response.index] = response.finish_reason
    return tokens, usage, finish


def test_seeded_stream_resumes_with_the_same_tokens(stack) -> None:
    sampling = dict(temperature=1.0, top_p=0.9, seed=17, max_tokens=24, ignore_eos=True)
    full, _, _ = generate(stack, "resume-full", sampling)
    cut = 9
    rest, usage, finish = generate(stack, "resume-rest", sampling, {0: full[0][:cut]})
    assert full[0][:cut] + rest[0] == full[0]
    assert usage[0] == 24 and finish[0] == common_pb2.FINISH_REASON_LENGTH
    stack.wait_until_idle()


def test_n_continues_only_the_listed_outputs(stack) -> None:
    sampling = dict(n=3, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    full, _, _ = generate(stack, "resume-n-full", sampling)
    rest, usage, _ = generate(stack, "resume-n-rest", sampling, {1: full[1][:4], 2: full[2][:10]})
    assert set(rest) == {1, 2}
    assert {i: full[i][: len(full[i]) - len(rest[i])] + rest[i] for i in rest} == {
        1: full[1],
        2: full[2],
    }
    assert usage == {1: 16, 2: 16}
    stack.wait_until_idle()


@pytest.mark.parametrize(
    ("resumed", "message"),
    [
        ({0: [5, 10**6]}, r"resumed_output_token_ids[0] holds ids outside the vocabulary"),
        ({1: [5]}, "resumed_output_token_ids[1]: the key must be an output index in [0, n=1)"),
        ({0: [5] * 8}, "resumed_output_token_ids[0] holds 8 tokens, max_tokens=8"),
    ],
)
def test_bad_resumed_tokens_are_invalid_argument(stack, resumed, message) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(stack, "resume-bad", dict(max_tokens=8), resumed)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    stack.wait_until_idle()
