"""Resuming a request with output tokens generated elsewhere (engine/processing/resume.py): for
every
sampling feature with state, a run cut after k tokens and resumed with those k tokens equals
the uninterrupted run. Tiny random models (vocabulary 128 where no text is involved, the
default model's tokenizer where it is)."""

from __future__ import annotations

import math

import pytest

from engine import EngineArgs, LLMEngine, RequestOutput, RequestOutputKind, SamplingParams
from engine.structured_output import StructuredOutputsParams
from tests.model_utils import make_tiny_llama

PROMPT = {"prompt_token_ids": [3 + (7 * i) % 120 for i in range(20)]}
CUT = 14  # prompt (20) + 14 output tokens cover two full blocks of 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=256)
    # fp32: a resumed run recomputes the cut tokens as prefill, which matches the decode
    # steps token for token only in fp32 ("auto" is bf16 on CPUs where bf16 is native).
    return LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), dtype="float32"))


@pytest.fixture(scope="module")
def text_engine(tmp_path_factory) -> LLMEngine:
    model_dir = make_tiny_llama(
        tmp_path_factory.mktemp("tiny-text"), with_tokenizer=True, max_position_embeddings=256
    )
    return LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), dtype="float32"))


_counter = iter(range(1_000_000))


def run(engine: LLMEngine, params: SamplingParams, resumed=None, prompt=PROMPT) -> RequestOutput:
    """The final output of one request (CUMULATIVE), run alone to completion."""
    request_id = f"r{next(_counter)}"
    engine.add_request(request_id, prompt, params, resumed_output_token_ids=resumed)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final = output
    assert final is not None and final.request_id == request_id
    assert engine.kv_cache_manager.get_num_free_blocks() == engine.get_cache_config().num_blocks
    return final


def assert_resumes(engine: LLMEngine, params: SamplingParams, cut: int = CUT, prompt=PROMPT):
    """Runs `params` whole, then cut after `cut` tokens and resumed; returns both finals."""
    full = run(engine, params, prompt=prompt)
    tokens = full.outputs[0].token_ids
    assert len(tokens) > cut, "the uninterrupted run must outlast the cut"
    resumed = run(engine, params, {0: tokens[:cut]}, prompt=prompt)
    (out,) = resumed.outputs
    assert out.token_ids == tokens
    assert out.text == full.outputs[0].text
    assert (out.finish_reason, out.stop_reason) == (
        full.outputs[0].finish_reason,
        full.outputs[0].stop_reason,
    )
    return full, resumed


# ---- the sampler's position, greedy, penalties, limits ----------------------------------------


def test_seeded_sampling_continues_at_the_same_position(engine) -> None:
    kw = dict(temperature=1.0, top_k=20, top_p=0.95, seed=11)
    full, _ = assert_resumes(engine, SamplingParams(**kw, max_tokens=32))
    # A run that started over at position 0 with the same context would draw other numbers.
    head, tail = full.outputs[0].token_ids[:CUT], full.outputs[0].token_ids[CUT:]
    as_prompt = {"prompt_token_ids": PROMPT["prompt_token_ids"] + head}
    restarted = run(engine, SamplingParams(**kw, max_tokens=len(tail)), prompt=as_prompt)
    assert restarted.outputs[0].token_ids != tail


def test_greedy_resumes_exactly(engine) -> None:
    assert_resumes(engine, SamplingParams(temperature=0.0, max_tokens=30))


def test_unseeded_sampling_resumes_within_limits(engine) -> None:
    """No seed, no promise of the same tokens; but the budget still counts the resumed ones."""
    params = SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True)
    resumed = run(engine, params, {0: list(range(10, 10 + CUT))})
    (out,) = resumed.outputs
    assert out.token_ids[:CUT] == list(range(10, 10 + CUT))
    assert len(out.token_ids) == 25 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "penalties",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.0},
        {"repetition_penalty": 1.8},
        {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
    ],
)
def test_penalties_see_resumed_tokens_as_output(engine, penalties) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30, **penalties)
    full, _ = assert_resumes(engine, params)
    plain = run(engine, SamplingParams(temperature=0.0, max_tokens=30))
    assert plain.outputs[0].token_ids != full.outputs[0].token_ids, "the penalty must matter"


def test_max_tokens_counts_resumed_tokens(engine) -> None:
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=20, ignore_eos=True)
    _, resumed = assert_resumes(engine, params, cut=12)
    assert len(resumed.outputs[0].token_ids) == 20
    assert resumed.outputs[0].finish_reason == "length"


def test_min_tokens_counts_resumed_tokens(engine) -> None:
    """A stop token sampled after min_tokens but before cut + min_tokens ends both runs at
    the same place (a resumed run counting min_tokens from the cut would ban it)."""
    min_tokens, cut = 10, 6
    base = dict(temperature=1.0, seed=5, max_tokens=40)
    free = run(engine, SamplingParams(**base, ignore_eos=True)).outputs[0].token_ids
    candidates = sorted(set(free))  # (banning stops changes the draws: try them all)
    for stop_token in candidates:
        params = SamplingParams(**base, min_tokens=min_tokens, stop_token_ids=[stop_token])
        full = run(engine, params).outputs[0]
        if full.finish_reason == "stop" and min_tokens < len(full.token_ids) <= min_tokens + cut:
            break
    else:
        pytest.fail(f"no stop token among {candidates} stops between the limits")
    assert_resumes(engine, params, cut=cut)


def test_stop_token_ids_are_checked_after_the_resumed_tokens(engine) -> None:
    """A stop id inside the resumed tokens does not end the request: the checks start after
    them (the caller resubmits only outputs that did not stop)."""
    params = SamplingParams(temperature=0.0, max_tokens=20)
    tokens = run(engine, params).outputs[0].token_ids
    stop = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[tokens[3]])
    out = run(engine, stop, {0: tokens[:CUT]}).outputs[0]
    assert out.token_ids[:CUT] == tokens[:CUT] and len(out.token_ids) > CUT


def test_logprobs_are_reported_for_new_tokens_only(engine) -> None:
    params = SamplingParams(temperature=0.8, seed=21, max_tokens=24, logprobs=3, ignore_eos=True)
    full, resumed = assert_resumes(engine, params)
    full_lp, new_lp = full.outputs[0].logprobs, resumed.outputs[0].logprobs
    assert len(new_lp) == len(full_lp) - CUT
    for expected, got in zip(full_lp[CUT:], new_lp):
        assert expected.keys() == got.keys()
        for token_id, logprob in expected.items():
            assert math.isclose(got[token_id].logprob, logprob.logprob, abs_tol=1e-4)
            assert got[token_id].rank == logprob.rank
    tail_sum = sum(next(iter(d.values())).logprob for d in full_lp[CUT:])
    assert math.isclose(resumed.outputs[0].cumulative_logprob, tail_sum, abs_tol=1e-3)


def test_prefix_cache_reuses_prompt_and_output(engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24)
    full = run(engine, params)
    resumed = run(engine, params, {0: full.outputs[0].token_ids[:CUT]})
    # Prompt 20 + 14 output tokens: two full blocks (32 tokens) were cached by the first run.
    assert resumed.num_cached_tokens == 32


# ---- n > 1 ------------------------------------------------------------------------------------


def test_n_resumes_the_listed_outputs_with_their_seeds(engine) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=20, ignore_eos=True)
    full = run(engine, params)
    by_index = {o.index: o.token_ids for o in full.outputs}
    assert len({tuple(t) for t in by_index.values()}) == 3, "the samples must differ"
    resumed = run(engine, params, {2: by_index[2][:5], 0: by_index[0][:CUT]})
    assert [o.index for o in resumed.outputs] == [0, 2]
    assert {o.index: o.token_ids for o in resumed.outputs} == {0: by_index[0], 2: by_index[2]}


def test_delta_stream_continues_where_the_first_left_off(text_engine) -> None:
    """DELTA: the text delivered before the cut plus the resumed stream's deltas is the
    uninterrupted text, including text held back as a possible stop-string start."""
    tokenizer = text_engine.get_tokenizer()
    prompt = {"prompt_token_ids": list(tokenizer("Once upon a time").input_ids)}
    kw = dict(temperature=0.0, max_tokens=24, stop=["no such stop string"], ignore_eos=True)
    full = run(text_engine, SamplingParams(**kw), prompt=prompt).outputs[0]
    delivered = _delta_text(text_engine, kw, None, prompt)
    assert len(delivered) < len(tokenizer.decode(full.token_ids[:CUT])), "some text held back"
    rest = _delta_text(text_engine, kw, {0: full.token_ids[:CUT]}, prompt)
    assert delivered + rest == full.text


def _delta_text(engine, kw, resumed, prompt) -> str:
    """The text a DELTA consumer sees: to the end when resumed, else until the stream has
    delivered CUT tokens (then it is aborted, and the abort's flush is not counted)."""
    params = SamplingParams(**kw, output_kind=RequestOutputKind.DELTA)
    request_id = f"d{next(_counter)}"
    engine.add_request(request_id, prompt, params, resumed_output_token_ids=resumed)
    text, num_tokens = "", 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            (completion,) = output.outputs
            num_tokens += len(completion.token_ids)
            if resumed is None and num_tokens > CUT:
                engine.abort_request(request_id)
                continue
            text += completion.text
    engine.step()  # the abort's output (not counted)
    return text


# ---- text: stop strings, grammars ---------------------------------------------------------------


def test_stop_string_after_the_cut_and_across_it(text_engine) -> None:
    """A stop string in the new text ends both runs at the same place, also one that begins
    in the resumed tokens' text and ends in a new token's."""
    tokenizer = text_engine.get_tokenizer()
    prompt = {"prompt_token_ids": list(tokenizer("The quick brown fox").input_ids)}
    free = run(text_engine, SamplingParams(temperature=0.0, max_tokens=30), prompt=prompt)
    text = free.outputs[0].text
    cut_text = tokenizer.decode(free.outputs[0].token_ids[:CUT])
    assert text.startswith(cut_text) and len(text) > len(cut_text) + 4
    for start, end in (
        (len(cut_text) + 2, len(cut_text) + 5),
        (len(cut_text) - 2, len(cut_text) + 2),
    ):
        stop = text[start:end]  # after the cut, then across it
        assert text.find(stop) == start, "its first occurrence must be the one at the cut"
        params = SamplingParams(temperature=0.0, max_tokens=30, stop=[stop])
        full, _ = assert_resumes(text_engine, params, prompt=prompt)
        assert full.outputs[0].finish_reason == "stop" and full.outputs[0].stop_reason == stop


def test_json_schema_grammar_advances_over_resumed_tokens(text_engine) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    }
    params = SamplingParams(
        temperature=0.9,
        seed=4,
        max_tokens=30,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    prompt = {"prompt_token_ids": list(text_engine.get_tokenizer()("JSON:").input_ids)}
    assert_resumes(text_engine, params, cut=6, prompt=prompt)


def test_resumed_tokens_the_grammar_refuses_abort_the_request(text_engine) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=10, structured_outputs=StructuredOutputsParams(regex="[0-9]+")
    )
    refused = list(text_engine.get_tokenizer()("hello").input_ids)
    out = run(text_engine, params, {0: refused}, prompt={"prompt_token_ids": [5, 6, 7]})
    assert out.outputs[0].finish_reason == "abort"


# ---- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("resumed", "max_tokens", "message"),
    [
        ([[1, 2]], 8, "must map output indices"),
        ({}, 8, "at least one output"),
        (
            {1: [3]},
            8,
            r"resumed_output_token_ids\[1\]: the key must be an output index in \[0, n=1\)",
        ),
        ({0: [3, 128]}, 8, r"resumed_output_token_ids\[0\] holds ids outside the vocabulary"),
        ({0: [3, -1]}, 8, r"resumed_output_token_ids\[0\] holds ids outside the vocabulary"),
        ({0: [3] * 8}, 8, r"resumed_output_token_ids\[0\] holds 8 tokens, max_tokens=8"),
        ({0: [3] * 236}, 300, r"resumed_output_token_ids\[0\]: .* \(max_model_len\)"),
        ({0: "abc"}, 8, "must be a list of ints"),
    ],
)
def test_bad_resumed_tokens_are_refused_by_name(engine, resumed, max_tokens, message) -> None:
    params = SamplingParams(max_tokens=max_tokens)
    with pytest.raises((TypeError, ValueError), match=message):
        engine.add_request("bad", PROMPT, params, resumed_output_token_ids=resumed)
    assert not engine.has_unfinished_requests()


def test_pooling_requests_cannot_resume(engine) -> None:
    from engine import PoolingParams

    with pytest.raises(ValueError, match="resumed_output_token_ids applies to generation"):
        engine.add_request("pool", PROMPT, PoolingParams(), resumed_output_token_ids={0: [3]})


def test_default_model_greedy_resume() -> None:
    engine = LLMEngine.from_engine_args(EngineArgs())
    prompt = {
        "prompt_token_ids": list(engine.get_tokenizer()("The capital of France is").input_ids)
    }
    assert_resumes(engine, SamplingParams(temperature=0.0, max_tokens=24), cut=9, prompt=prompt)
