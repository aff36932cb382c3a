"""Structured outputs on the default model: JSON schemas, regex, choice and an EBNF grammar
are enforced (outputs validated by jsonschema / re / a parser), finish with "stop", and
compose with n > 1, seeds, logprobs, preemption and speculative decoding."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from engine.api.sampling_params import SamplingParams
from engine.llm import LLM
from engine.structured_output import StructuredOutputsParams

NAME = {"type": "string", "minLength": 1, "maxLength": 8}
SCHEMAS: list[dict] = [
    {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "city": NAME,
            "location": {
                "type": "object",
                "properties": {
                    "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                    "lon": {"type": "integer", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
            },
        },
        "required": ["city", "location"],
    },
    {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 10},
                "minItems": 1,
                "maxItems": 4,
            }
        },
        "required": ["scores"],
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
    },
    {
        "type": "object",
        "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000}},
        "required": ["price"],
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "nick": NAME,
            "admin": {"type": "boolean"},
        },
        "required": ["id"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": NAME,
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "qty"],
                },
            }
        },
        "required": ["items"],
    },
    {"enum": ["alpha", "beta", "gamma"]},
    {
        "type": "object",
        "properties": {"level": {"type": "integer", "exclusiveMinimum": 0, "maximum": 5}},
        "required": ["level"],
    },
    {
        "type": "array",
        "items": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "maxItems": 2,
        },
        "minItems": 1,
        "maxItems": 2,
    },
    {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"],
    },
    {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": -99, "maximum": 99}, NAME]}
        },
        "required": ["value"],
    },
]
NUM_GENERATIONS = 200


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory_bytes=256 * 2**20, max_num_seqs=256)


def _params(seed: int, max_tokens: int = 80, **constraint) -> SamplingParams:
    return SamplingParams(
        temperature=0.8,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**constraint, disable_any_whitespace=True),
    )


def test_json_schemas_200_generations_validate(llm: LLM) -> None:
    cases = [(SCHEMAS[i % len(SCHEMAS)], i) for i in range(NUM_GENERATIONS)]
    # Short prompts keep the prefill small: the grammar, not the prompt, shapes the output.
    prompts = [f"Data {i % len(SCHEMAS)} as JSON:" for i in range(NUM_GENERATIONS)]
    params = [_params(seed, json=schema) for schema, seed in cases]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outputs) == NUM_GENERATIONS
    for (schema, seed), output in zip(cases, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (seed, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def test_regex_choice_and_grammar(llm: LLM) -> None:
    regex = r"[A-Z][a-z]{2,6} [0-9]{3}-[0-9]{4}"
    choices = ["yes", "no", "maybe so"]
    grammar = """
root ::= expr
expr ::= term (op term)? (op term)?
term ::= num | "(" num op num ")"
op ::= "+" | "-" | "*"
num ::= [1-9] [0-9]?
"""
    params = (
        [_params(s, regex=regex) for s in range(4)]
        + [_params(s, choice=choices) for s in range(4)]
        + [_params(s, grammar=grammar) for s in range(4)]
    )
    prompts = ["Name and phone:"] * 4 + ["Is it raining?"] * 4 + ["An arithmetic sum:"] * 4
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(out.finish_reason == "stop" for out in outputs), [o.text for o in outputs]
    for out in outputs[:4]:
        assert re.fullmatch(regex, out.text), out.text
    assert all(out.text in choices for out in outputs[4:8])
    num = r"[1-9][0-9]?"
    term = rf"(?:{num}|\({num}[-+*]{num}\))"
    for out in outputs[8:]:
        assert re.fullmatch(rf"{term}(?:[-+*]{term}){{0,2}}", out.text), out.text
        assert isinstance(eval(out.text, {}), int)  # a well-formed expression


def test_greedy_choice_matches_masked_argmax_and_logprobs(llm: LLM) -> None:
    """The constrained answer is the most likely allowed choice; logprobs are those of
    the masked distribution (the two allowed first tokens carry all the mass)."""
    params = SamplingParams(
        temperature=0.0,
        logprobs=3,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["Paris", "London"]),
    )
    out = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    assert out.text == "Paris" and out.finish_reason == "stop"
    tokenizer = llm.get_tokenizer()
    allowed = [
        (tokenizer.decode([token_id]), lp.logprob)
        for token_id, lp in out.logprobs[0].items()
        if lp.logprob != float("-inf")
    ]
    # Only tokens that start one of the choices carry probability.
    assert allowed and all("Paris".startswith(t) or "London".startswith(t) for t, _ in allowed)
    assert sum(math.exp(v) for _, v in allowed) <= 1.0 + 1e-5


def test_n_samples_and_seeds(llm: LLM) -> None:
    schema = SCHEMAS[0]
    constraint = StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True)
    params = SamplingParams(
        n=4, temperature=0.9, seed=7, max_tokens=64, structured_outputs=constraint
    )
    first = llm.generate("A person as JSON:", params, use_tqdm=False)[0]
    second = llm.generate("A person as JSON:", params, use_tqdm=False)[0]
    assert [c.text for c in first.outputs] == [c.text for c in second.outputs]
    for c in first.outputs:
        jsonschema.validate(json.loads(c.text), schema)


def test_completed_grammar_wins_over_min_tokens(llm: LLM) -> None:
    """A choice is complete after a token or two while min_tokens asks for 6: the grammar
    then allows only EOS, which min_tokens would ban. As in vLLM, the completed grammar
    wins: the request ends with "stop" on the choice alone, greedy and random, alongside
    an unconstrained min_tokens request that still honours min_tokens."""
    choices = ["yes", "no"]
    constrained = [
        SamplingParams(
            temperature=t,
            seed=s,
            min_tokens=6,
            max_tokens=12,
            structured_outputs=StructuredOutputsParams(choice=choices),
        )
        for t, s in [(0.0, 0), (0.8, 1), (0.8, 2)]
    ]
    plain = SamplingParams(temperature=0.0, min_tokens=6, max_tokens=6)
    outputs = llm.generate(["Is it raining?"] * 4, [*constrained, plain], use_tqdm=False)
    eos = llm.get_tokenizer().eos_token_id
    for output in outputs[:3]:
        out = output.outputs[0]
        assert out.text in choices and out.finish_reason == "stop", (out.text, out.token_ids)
        # Ended before min_tokens on the grammar's EOS, not on a token forced past the mask.
        assert len(out.token_ids) < 6 and out.token_ids[-1] == eos, out.token_ids
    assert len(outputs[3].outputs[0].token_ids) == 6


def test_structural_tag(llm: LLM) -> None:
    """xgrammar's structural tag: the JSON value inside <answer>..</answer> follows the
    schema and the output is exactly the tag."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<answer>",
            "content": {"type": "json_schema", "json_schema": schema},
            "end": "</answer>",
        },
    }
    params = [_params(s, 60, structural_tag=tag) for s in range(3)]
    params.append(_params(3, 60, structural_tag=json.dumps(tag)))  # JSON text too
    outputs = llm.generate(["The capital of France:"] * 4, params, use_tqdm=False)
    for output in outputs:
        out = output.outputs[0]
        assert out.finish_reason == "stop", out.text
        match = re.fullmatch(r"<answer>(.*)</answer>", out.text, re.DOTALL)
        assert match, out.text
        jsonschema.validate(json.loads(match.group(1)), schema)


def test_structural_tag_legacy_form(llm: LLM) -> None:
    """vLLM's older structural tag (structures + triggers): free text until a trigger, then
    the tag's schema; checked on the matcher with the model's own tokens. A malformed one
    is a ValueError naming the field."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<answer>", "schema": schema, "end": "</answer>"}],
        "triggers": ["<answer>"],
    }
    backend = llm.llm_engine.structured_output_manager._get_backend()
    compiled = backend.compile(StructuredOutputsParams(structural_tag=tag))
    tokenizer = llm.get_tokenizer()

    def accepts(text: str) -> bool:
        matcher = backend.new_matcher(compiled)
        return all(matcher.accept_token(t) for t in tokenizer(text).input_ids)

    assert accepts('Sure. <answer>{"city": "Paris"}</answer> Done.')
    assert not accepts('Sure. <answer>{"town": 1}</answer>')
    with pytest.raises(ValueError, match=r"structured_outputs\.structural_tag"):
        llm.generate("x", _params(0, structural_tag={"structures": [{"begin": "<a>"}]}))


def test_bad_specs_are_rejected_naming_the_field(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"exactly one of.*json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar was rejected by xgrammar"):
        llm.generate("x", _params(0, grammar="root ::= "), use_tqdm=False)
    with pytest.raises(ValueError, match=r"structured_outputs\.json"):
        llm.generate("x", _params(0, json='{"type": "nonsense"}'), use_tqdm=False)
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        llm.generate("x", _params(0, regex="(unclosed"), use_tqdm=False)
    assert llm.llm_engine.kv_cache_manager.usage == 0.0
    assert llm.llm_engine.get_decoding_config().backend == "xgrammar"


def test_preemption_and_prefix_caching_keep_outputs(tmp_path) -> None:
    """A cache small enough to preempt constrained requests: outputs equal an unpreempted
    run's and still validate; a repeated prompt (prefix-cache hit) gives the same text."""
    schema = SCHEMAS[0]
    prompts = [f"Person {i} as JSON:" for i in range(4)]
    params = [_params(i, 48, json=schema) for i in range(4)]
    roomy = LLM(kv_cache_memory_bytes=64 * 2**20, enable_prefix_caching=True)
    expected = [o.outputs[0].text for o in roomy.generate(prompts, params, use_tqdm=False)]
    again = [o.outputs[0].text for o in roomy.generate(prompts, params, use_tqdm=False)]
    assert again == expected
    del roomy
    tight = LLM(num_gpu_blocks_override=5, block_size=16)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.num_preemptions_total > 0
    assert [o.outputs[0].text for o in got] == expected
    for text in expected:
        jsonschema.validate(json.loads(text), schema)


def test_speculative_drafts_are_checked_against_the_grammar(tmp_path) -> None:
    """n-gram drafts copied from a prompt full of tokens the regex forbids: verification
    under the grammar rejects them, so outputs equal the run without speculation."""
    from tests.model_utils import make_tiny_llama

    model = str(make_tiny_llama(tmp_path / "tiny", with_tokenizer=True))
    regex = r"[a-c ]{8,30}"
    llm = LLM(model, kv_cache_memory_bytes=16 * 2**20)
    ids = list(llm.get_tokenizer()("a b c x y z 1 2 3 a b c x y z 1 2 3 a b c").input_ids)
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(regex=regex),
        ),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),  # unconstrained
    ]
    prompts = [{"prompt_token_ids": ids}] * 2
    expected = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    spec = LLM(
        model,
        kv_cache_memory_bytes=16 * 2**20,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    got = [o.outputs[0] for o in spec.generate(prompts, params, use_tqdm=False)]
    assert spec.llm_engine.scheduler.num_draft_tokens > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert re.fullmatch(regex, got[0].text), got[0].text
