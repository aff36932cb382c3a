"""logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens and logits_processors on a
tiny random model with the default model's tokenizer: each checked against an unconstrained
reference run, and bad values rejected naming the field."""

from __future__ import annotations

import pytest

from engine.api.sampling_params import SamplingParams
from engine.llm import LLM

PROMPT = {"prompt_token_ids": [1, 504, 3458, 314, 253, 1345, 28, 216, 4493]}


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    from tests.model_utils import make_tiny_llama

    path = make_tiny_llama(tmp_path_factory.mktemp("controls"), with_tokenizer=True)
    return LLM(str(path), kv_cache_memory_bytes=16 * 2**20)


def _tokens(llm: LLM, params: SamplingParams, prompt=PROMPT) -> list[int]:
    return list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)


def test_logit_bias_pushes_a_token_first(llm: LLM) -> None:
    reference = _tokens(llm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    target = 4000 if reference[0] != 4000 else 4001
    biased = SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={target: 100.0}
    )
    assert all(t == target for t in _tokens(llm, biased))
    # A strong negative bias on the reference's first token moves it off.
    banned = SamplingParams(temperature=0.0, max_tokens=1, logit_bias={reference[0]: -100.0})
    assert _tokens(llm, banned)[0] != reference[0]


def test_allowed_token_ids_only_those(llm: LLM) -> None:
    allowed = [17, 257, 1000, 31337]
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed
    )
    tokens = _tokens(llm, params)
    assert len(tokens) == 24 and set(tokens) <= set(allowed)
    assert len(set(tokens)) > 1  # sampled among them, not stuck on one


def test_bad_words_never_appear(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    reference = _tokens(llm, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    word = tokenizer.decode(reference[:2]).strip() or tokenizer.decode(reference[:3]).strip()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, bad_words=[word])
    output = _tokens(llm, params)
    assert output != reference
    for sequence in (
        tokenizer(word, add_special_tokens=False).input_ids,
        tokenizer(" " + word, add_special_tokens=False).input_ids,
    ):
        n = len(sequence)
        assert all(output[i : i + n] != sequence for i in range(len(output) - n + 1))


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, truncate_prompt_tokens=4)
    output = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert output.prompt_token_ids == PROMPT["prompt_token_ids"][-4:]
    reference = _tokens(llm, SamplingParams(temperature=0.0, max_tokens=3), {
        "prompt_token_ids": PROMPT["prompt_token_ids"][-4:]
    })  # fmt: skip
    assert list(output.outputs[0].token_ids) == reference


def test_logits_processors_both_signatures(llm: LLM) -> None:
    seen: list[tuple[int, int]] = []

    def force_seven(output_ids, logits):
        logits[:] = float("-inf")
        logits[7] = 0.0
        return logits

    def record(prompt_ids, output_ids, logits):
        seen.append((len(prompt_ids), len(output_ids)))
        return logits

    params = SamplingParams(
        temperature=0.7, seed=1, max_tokens=5, logits_processors=[record, force_seven]
    )
    assert _tokens(llm, params) == [7] * 5
    assert seen == [(len(PROMPT["prompt_token_ids"]), i) for i in range(5)]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 500.0}}, "logit_bias"),
        ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"logits_processors": [3]}, "logits_processors"),
    ],
)
def test_bad_values_are_rejected_naming_the_field(llm: LLM, kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        llm.generate(PROMPT, SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.kv_cache_manager.usage == 0.0


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("constrained", [None, [0, 3, 4]])  # every row / some rows
def test_grammar_bitmask_matches_a_bit_by_bit_reference(dtype, constrained) -> None:
    """The vectorised in-place bitmask against bit-by-bit unpacking, with a vocabulary that
    is not a multiple of 32 and negative (high-bit) words; rows without a grammar keep
    their logits bit for bit."""
    import torch

    from engine.sample.token_controls import apply_grammar_bitmask_

    num_rows, vocab = 5, 100
    logits = torch.randn(num_rows, vocab).to(getattr(torch, dtype))
    rows = list(range(num_rows)) if constrained is None else constrained
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), 4), dtype=torch.int32)
    allowed = torch.ones(num_rows, vocab, dtype=torch.bool)
    for g, r in enumerate(rows):
        allowed[r] = torch.tensor(
            [(int(bitmask[g, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
        )
    expected = torch.where(allowed, logits, float("-inf"))
    row_ids = None if constrained is None else torch.tensor(constrained)
    out = apply_grammar_bitmask_(logits, bitmask, row_ids)
    assert out.data_ptr() == logits.data_ptr()  # in place: no copy of the logits
    assert torch.equal(logits, expected)
    assert torch.isinf(logits).any() and not torch.isinf(logits[allowed]).any()


def test_stop_strings_without_an_engine_tokenizer(tmp_path) -> None:
    """skip_tokenizer_init (token ids in and out, as the engine service runs): stop strings
    are matched with the model directory's tokenizer, loaded on first use; a directory
    without one refuses them naming `stop`, and the engine goes on serving."""
    from engine import EngineArgs, LLMEngine
    from tests.model_utils import make_tiny_llama

    def engine(model_dir) -> LLMEngine:
        args = EngineArgs(
            model=str(model_dir), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22
        )
        return LLMEngine.from_engine_args(args)

    def run(eng: LLMEngine, request_id: str, **params) -> object:
        eng.add_request(request_id, {"prompt_token_ids": [5, 9, 13]}, SamplingParams(**params))
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    return out.outputs[0]
        raise AssertionError("no output")

    bare = engine(make_tiny_llama(tmp_path / "bare"))
    with pytest.raises(ValueError, match="stop"):
        bare.add_request("s", {"prompt_token_ids": [5, 9]}, SamplingParams(stop=["x"]))
    assert len(run(bare, "ok", temperature=0, max_tokens=3).token_ids) == 3

    eng = engine(make_tiny_llama(tmp_path / "tok", with_tokenizer=True))
    greedy = run(eng, "g", temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
    assert eng.tokenizer is None  # the engine itself still has none
    text = eng.output_processor._get_stop_tokenizer().decode(greedy.token_ids[3:5]).strip()
    assert text
    stopped = run(eng, "s", temperature=0, max_tokens=8, ignore_eos=True, stop=[text])
    assert stopped.finish_reason == "stop" and stopped.stop_reason == text
    assert len(stopped.token_ids) < 8
