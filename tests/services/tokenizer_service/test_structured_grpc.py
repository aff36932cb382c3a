"""Structured outputs, the new sampling fields and beam search through both services: the
tokenizer service forwards the `constraint` oneof, the engine enforces it; outputs equal
offline `LLM` runs; bad values are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from engine import SamplingParams
from engine.api.sampling_params import BeamSearchParams
from engine.structured_output import StructuredOutputsParams
from pagedserve.v1 import common_pb2
from tests.services.helpers import gather, request, wait_for

SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"enum": ["x", "y"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["a", "n"],
}
PROMPT = [1, 504, 3458, 314, 253, 1345, 28]


def _offline(llm, **params):
    output = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(**params), use_tqdm=False)
    return output[0].outputs[0]


def test_json_schema_and_choice_are_enforced_as_offline(stack, offline_llm):
    req = request(token_ids=PROMPT, temperature=0.8, seed=5, max_tokens=40)
    req.sampling_params.json_schema = json.dumps(SCHEMA)
    req.sampling_params.disable_any_whitespace = True
    (out,) = gather(stack.public.Generate(req, timeout=60)).values()
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert out.finish_reason == common_pb2.FINISH_REASON_STOP
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    expected = _offline(
        offline_llm, temperature=0.8, seed=5, max_tokens=40, structured_outputs=constraint
    )
    assert out.token_ids == list(expected.token_ids)

    req = request(token_ids=PROMPT, temperature=1.0, seed=1, max_tokens=10)
    req.sampling_params.choice.choices.extend(["alpha", "beta"])
    (out,) = gather(stack.public.Generate(req, timeout=60)).values()
    assert out.text in ("alpha", "beta")


def test_token_controls_match_offline(stack, offline_llm):
    kwargs = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    reference = _offline(offline_llm, **kwargs)
    word = offline_llm.get_tokenizer().decode(reference.token_ids[:2]).strip()
    req = request(token_ids=PROMPT, bad_words=[word], **kwargs)
    req.sampling_params.logit_bias[4000] = 5.0
    (out,) = gather(stack.public.Generate(req, timeout=60)).values()
    expected = _offline(offline_llm, bad_words=[word], logit_bias={4000: 5.0}, **kwargs)
    assert out.token_ids == list(expected.token_ids)

    req = request(token_ids=PROMPT, allowed_token_ids=[17, 99], truncate_prompt_tokens=3, **kwargs)
    (out,) = gather(stack.public.Generate(req, timeout=60)).values()
    assert set(out.token_ids) <= {17, 99}
    assert out.usage.prompt_tokens == 3


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("regex", "(unclosed", "structured_outputs.regex"),
        ("grammar", "root ::= ", "structured_outputs.grammar"),
        ("json_schema", "{not json", "structured_outputs.json"),
        ("allowed_token_ids", [10**6], "allowed_token_ids"),
        ("truncate_prompt_tokens", 0, "truncate_prompt_tokens"),
    ],
)
def test_bad_values_are_invalid_argument(stack, field, value, named):
    req = request(token_ids=PROMPT, max_tokens=4)
    if isinstance(value, list):
        getattr(req.sampling_params, field).extend(value)
    else:
        setattr(req.sampling_params, field, value)
    with pytest.raises(grpc.RpcError) as info:
        gather(stack.public.Generate(req, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in info.value.details()
    stack.wait_until_idle()


def test_beam_width_returns_the_final_beams(stack, offline_llm):
    req = request(token_ids=PROMPT, max_tokens=6)
    req.beam_width = 3
    req.length_penalty = 0.5
    outputs = gather(stack.public.Generate(req, timeout=60))
    assert sorted(outputs) == [0, 1, 2]
    (expected,) = offline_llm.beam_search(
        [{"prompt_token_ids": PROMPT}],
        BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5),
    )
    for index, beam in enumerate(expected.sequences):
        assert outputs[index].token_ids == beam.tokens[len(PROMPT) :]
        assert outputs[index].num_messages == 1
    stack.wait_until_idle()


def test_abort_stops_a_beam_search(stack):
    """An Abort ends a beam search between or during its steps: the beams so far come back
    with finish_reason ABORT, and the engine is left with no request and no block."""
    import threading

    req = request(token_ids=PROMPT, max_tokens=4000, ignore_eos=True, request_id="beam-abort")
    req.beam_width = 4
    result: dict = {}

    def run() -> None:
        result["outputs"] = gather(stack.public.Generate(req, timeout=120))

    generated_before = stack.stats().num_generation_tokens_total
    thread = threading.Thread(target=run)
    thread.start()
    # The search is under way (a step has generated tokens) before the Abort is sent, and
    # its 4000 steps take tens of seconds: the Abort certainly comes first.
    wait_for(lambda: stack.stats().num_generation_tokens_total > generated_before)
    reply = stack.public.Abort(common_pb2.AbortRequest(request_ids=["beam-abort"]), timeout=10)
    assert list(reply.aborted_request_ids) == ["beam-abort"]
    thread.join(timeout=120)
    assert not thread.is_alive(), "the aborted beam search did not end"
    outputs = result["outputs"]
    assert 1 <= len(outputs) <= 4  # 4 beams after the first step; 1 if aborted before it
    for out in outputs.values():
        assert out.finish_reason == common_pb2.FINISH_REASON_ABORT
        assert len(out.token_ids) < 4000
    stack.wait_until_idle()
