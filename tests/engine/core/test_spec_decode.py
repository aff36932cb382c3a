"""N-gram speculative decoding: the proposer (no torch), the config, and end to end: greedy
outputs with speculation must be exactly those without it, under every scheduling regime."""

from __future__ import annotations

import random

import pytest

from engine.api.sampling_params import SamplingParams
from engine.config.engine_config import EngineArgs
from engine.config.resolved import SchedulerConfig
from engine.config.speculative import SpeculativeConfig
from engine.core import scheduler as scheduler_module
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.ngram_proposer import NgramProposer, can_speculate
from engine.core.request import Request
from engine.core.sched_output import ModelRunnerOutput
from engine.core.scheduler import Scheduler

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


def proposer(k: int = 4, max_n: int = 4, min_n: int = 1) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", k, max_n, min_n))


# ---- proposer ---------------------------------------------------------------------------


def test_proposes_what_followed_the_last_occurrence_of_the_suffix() -> None:
    assert proposer().propose([1, 2, 3, 4, 5, 6, 1, 2, 3]) == [4, 5, 6, 1]
    assert proposer(k=2).propose([1, 2, 3, 4, 5, 6, 1, 2, 3]) == [4, 5]
    assert proposer().propose([1, 2, 3, 4, 5, 6, 1, 2, 3], max_num_tokens=1) == [4]
    # A continuation that runs into the end repeats as the suffix's occurrence did.
    assert proposer().propose([7, 7, 7]) == [7, 7, 7, 7]
    assert proposer().propose([5, 1, 2, 1, 2]) == [1, 2, 1, 2]
    assert proposer(k=5).propose([9, 1, 2, 3, 1, 2]) == [3, 1, 2, 3, 1]


def test_prefers_the_longest_ngram_then_the_most_recent_occurrence() -> None:
    # "3" alone last occurred before 9; "2 3" occurred before 8.
    tokens = [2, 3, 8, 0, 3, 9, 0, 2, 3]
    assert proposer().propose(tokens) == [8, 0, 3, 9]
    assert proposer(max_n=1).propose(tokens) == [9, 0, 2, 3]
    assert proposer(k=6, max_n=1).propose(tokens) == [9, 0, 2, 3, 9, 0]
    # Two occurrences of "1 2": the later one wins.
    assert proposer(k=1).propose([1, 2, 5, 1, 2, 6, 1, 2]) == [6]


def test_no_proposal_without_a_match_or_below_min_n() -> None:
    assert proposer().propose([1, 2, 3, 4]) == []
    assert proposer().propose([1]) == []
    assert proposer().propose([]) == []
    assert proposer(min_n=2).propose([1, 9, 5, 1]) == []
    assert proposer(min_n=2).propose([1, 9, 5, 1], max_num_tokens=0) == []
    assert proposer().propose([1, 9, 5, 1], max_num_tokens=0) == []


def test_ignores_byte_matches_that_straddle_tokens() -> None:
    # As 4-byte words these ids share bytes at misaligned offsets; only aligned hits count.
    a, b = 0x01020304, 0x05060708
    straddle = 0x07080102
    assert proposer().propose([a, b, 0x0304_0506, straddle]) == []
    assert proposer(k=1).propose([b, a, 42, b, a]) == [42]


def test_large_ids_and_long_sequences() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(0, 200_000) for _ in range(10_000)]
    expected = tokens[-40:-36]
    tokens += tokens[-50:-40]  # repeat a 10-token run from near the end
    assert proposer().propose(tokens) == expected


def test_matches_a_naive_search() -> None:
    rng = random.Random(1)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        k, max_n, min_n = rng.randrange(1, 5), rng.randrange(1, 5), 1
        expected: list[int] = []
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            suffix = tokens[-n:]
            starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
            if starts:
                extended = list(tokens)
                start = starts[-1] + n
                while len(extended) < start + k:
                    extended.append(extended[len(extended) - (len(tokens) - start)])
                expected = extended[start : start + k]
                break
        assert proposer(k, max_n, min_n).propose(tokens) == expected, tokens


# ---- config -----------------------------------------------------------------------------


def test_speculative_config_validation() -> None:
    assert SpeculativeConfig.from_dict(None) is None
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert config is not None and config.num_speculative_tokens == 3
    with pytest.raises(NotImplementedError, match="eagle"):
        SpeculativeConfig.from_dict({"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.from_dict(
            {"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}
        )
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig.from_dict({"method": "ngram", "draft_model": "x"})
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_max": True})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineArgs(
            speculative_config={"method": "ngram", "num_speculative_tokens": -1}
        ).create_engine_config()


def test_only_plain_greedy_decode_requests_speculate() -> None:
    def request(**kwargs) -> Request:
        r = Request("r", [1, 2, 3], SamplingParams(**{"temperature": 0.0, **kwargs}))
        r.num_computed_tokens = 2
        return r

    assert can_speculate(request())
    for kwargs in (
        dict(temperature=0.7),
        dict(presence_penalty=0.5),
        dict(frequency_penalty=0.5),
        dict(repetition_penalty=1.2),
        dict(logprobs=1),
        dict(prompt_logprobs=1),
        dict(min_tokens=1),
        dict(stop=["x"]),
    ):
        assert not can_speculate(request(**kwargs)), kwargs
    prefill = request()
    prefill.num_computed_tokens = 0
    assert not can_speculate(prefill)


# ---- scheduler with a fake verifier -----------------------------------------------------


def test_scheduler_rolls_back_rejected_drafts() -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=256),
        KVCacheManager(64, 4),
        SpeculativeConfig(num_speculative_tokens=3),
    )
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    request = Request("r", [5, 6, 7, 5, 6], params)
    scheduler.add_request(request)
    out = scheduler.schedule()  # prefill
    runner = ModelRunnerOutput(sampled_token_ids={"r": 7})
    scheduler.update(out, runner)
    out = scheduler.schedule()  # "5 6 7" occurred: drafts 5 6 7
    (entry,) = out.scheduled
    assert entry.spec_token_ids == [5, 6, 7] and entry.num_new_tokens == 4
    assert entry.token_ids == [7, 5, 6, 7]
    assert entry.samples
    assert request.num_computed_tokens == 6 + 3
    # One draft accepted, then the verifier's own token 8.
    scheduler.update(out, ModelRunnerOutput(spec_output_token_ids={"r": [5, 8]}))
    assert request.output_token_ids == [7, 5, 8]
    assert request.num_computed_tokens == 7 and request.num_tokens == 8
    assert request.spec_token_ids == []
    assert scheduler.num_draft_tokens == 3 and scheduler.num_accepted_draft_tokens == 1
    assert scheduler.num_output_tokens_last_update == 2
    # "8" is new: no drafts, a plain decode step.
    out = scheduler.schedule()
    assert out.scheduled[0].spec_token_ids == []
    scheduler.update(out, ModelRunnerOutput(sampled_token_ids={"r": 5}))
    # "5" last occurred before "8 5": drafts 8 5 8 (the copy runs on); two accepted.
    out = scheduler.schedule()
    assert out.scheduled[0].spec_token_ids == [8, 5, 8]
    scheduler.update(out, ModelRunnerOutput(spec_output_token_ids={"r": [8, 5, 1]}))
    assert request.output_token_ids == [7, 5, 8, 5, 8, 5, 1]
    assert request.num_computed_tokens == request.num_tokens - 1


def test_scheduler_stops_inside_an_accepted_draft_run() -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=256),
        KVCacheManager(64, 4),
        SpeculativeConfig(num_speculative_tokens=3),
    )
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[4])
    request = Request("r", [1, 2, 3, 4, 1, 2], params)
    scheduler.add_request(request)
    scheduler.update(scheduler.schedule(), ModelRunnerOutput(sampled_token_ids={"r": 3}))
    out = scheduler.schedule()
    assert out.scheduled[0].spec_token_ids == [4, 1, 2]
    # The stop token 4 is the first accepted draft: what follows it is dropped.
    scheduler.update(out, ModelRunnerOutput(spec_output_token_ids={"r": [4, 1, 2, 9]}))
    assert request.output_token_ids == [3, 4] and request.is_finished()
    assert request.get_finished_reason() == "stop" and request.stop_reason == 4
    assert scheduler.num_output_tokens_last_update == 1
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 64
    assert not scheduler.has_unfinished_requests()


def test_drafts_respect_max_tokens_budget_and_free_blocks() -> None:
    def scheduled_drafts(num_blocks=64, budget=64, max_tokens=20, max_model_len=256):
        scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=budget, max_model_len=max_model_len),
            KVCacheManager(num_blocks, 4),
            SpeculativeConfig(num_speculative_tokens=4),
        )
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        scheduler.add_request(Request("r", [1, 2, 3, 4, 5, 6, 1, 2], params))
        while True:  # prefill, maybe chunked, then the first token
            out = scheduler.schedule()
            if out.scheduled[0].samples:
                break
            scheduler.update(out, ModelRunnerOutput())
        scheduler.update(out, ModelRunnerOutput(sampled_token_ids={"r": 3}))
        out = scheduler.schedule()
        return out.scheduled[0].spec_token_ids

    assert scheduled_drafts() == [4, 5, 6, 1]
    assert scheduled_drafts(max_tokens=3) == [4]  # 1 out; this step may add 2 more
    assert scheduled_drafts(max_model_len=11) == [4]
    assert scheduled_drafts(budget=3) == [4, 5]
    # 9 tokens fill 3 blocks of 4; a 4th is needed only by the drafts: they are dropped
    # rather than anything preempted.
    assert scheduled_drafts(num_blocks=3) == []


# ---- end to end: speculation never changes a greedy token --------------------------------

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.model_utils import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("spec"), max_position_embeddings=256)


@pytest.fixture(scope="module")
def looping_model(tmp_path_factory):
    """A 16-token vocabulary: greedy outputs fall into loops, so most drafts are accepted."""
    from tests.model_utils import make_tiny_llama

    path = tmp_path_factory.mktemp("spec16")
    return make_tiny_llama(path, max_position_embeddings=256, vocab_size=16)


def tiny_prompts(seed: int = 0, vocab_size: int = 128) -> list[list[int]]:
    rng = random.Random(seed)
    phrase = [rng.randrange(3, vocab_size) for _ in range(7)]
    prompts = [phrase * 5, phrase * 3 + phrase[:4]]  # repeats: drafts get accepted
    prompts += [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (1, 6, 23, 40)]
    return prompts


def generate(model, prompts, params, **engine_kwargs):
    from engine import LLM

    llm = LLM(model=str(model), dtype="float32", max_model_len=256, **engine_kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.kv_cache_manager.get_num_free_blocks() == engine.get_cache_config().num_blocks
    return engine, outputs


def mixed_params(n: int) -> list[SamplingParams]:
    """Per prompt: greedy (speculates), then sampling and logprobs (never speculate)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    logprobs = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    kinds = [greedy, greedy, sampled, logprobs]
    return [kinds[i % len(kinds)] for i in range(n)]


REGIMES = {
    "default": {},
    "preemption-tiny-cache": dict(num_gpu_blocks_override=24, block_size=4),
    "small-budget": dict(max_num_batched_tokens=16),
    "prefix-caching-off": dict(enable_prefix_caching=False),
}


def summary(outputs):
    return [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
        for o in outputs
    ]


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("vocab_size", [128, 16])
def test_tiny_model_outputs_equal_without_speculation(
    tiny_model, looping_model, regime, vocab_size
) -> None:
    model = tiny_model if vocab_size == 128 else looping_model
    prompts = tiny_prompts(vocab_size=vocab_size) * 2
    params = mixed_params(len(prompts))
    _, expected = generate(model, prompts, params, **REGIMES[regime])
    engine, outputs = generate(model, prompts, params, speculative_config=NGRAM, **REGIMES[regime])
    assert summary(outputs) == summary(expected)
    # Logprob requests never speculate, but a different schedule (preemption timing) may
    # batch their positions differently: equal ids, values equal up to float rounding.
    for ours, theirs in zip(outputs, expected):
        for a, b in zip(ours.outputs[0].logprobs or [], theirs.outputs[0].logprobs or []):
            assert a.keys() == b.keys()
            assert [x.logprob for x in a.values()] == pytest.approx(
                [x.logprob for x in b.values()], abs=1e-4
            )
    scheduler = engine.scheduler
    assert scheduler.num_accepted_draft_tokens > 0, "no draft was ever accepted"
    assert scheduler.num_accepted_draft_tokens <= scheduler.num_draft_tokens
    if regime == "preemption-tiny-cache":
        assert scheduler.num_preemptions_total > 0, "no preemption happened"
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert engine.stat_logger.total_generation_tokens == total
    assert "acceptance rate" in engine.do_log_stats()


def test_tiny_model_stops_and_lengths(looping_model) -> None:
    """For each prompt, every stop token and max_tokens that cut its greedy output, all in
    one batch (a random model rarely drafts a stop token that has not been output yet: the
    default-model test below checks stops inside accepted draft runs)."""
    prompts = tiny_prompts(seed=3, vocab_size=16)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    _, full = generate(looping_model, prompts, greedy)
    cases: list[tuple[list[int], SamplingParams, list[int]]] = []  # prompt, params, expected
    for prompt, output in zip(prompts, full):
        tokens = list(output.outputs[0].token_ids)
        firsts = {t: i for i, t in reversed(list(enumerate(tokens)))}  # first position of each
        for t, i in firsts.items():
            params = SamplingParams(
                temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[t]
            )
            cases.append((prompt, params, tokens[: i + 1]))
        for m in range(1, MAX_TOKENS, 3):
            params = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
            cases.append((prompt, params, tokens[:m]))

    engine, outputs = generate(
        looping_model,
        [prompt for prompt, _, _ in cases],
        [params for _, params, _ in cases],
        speculative_config=NGRAM,
    )
    assert engine.scheduler.num_accepted_draft_tokens > 0
    check_cases(outputs, cases)


def check_cases(outputs, cases) -> None:
    for output, (_, params, expected) in zip(outputs, cases):
        completion = output.outputs[0]
        assert completion.token_ids == expected
        if params.stop_token_ids:
            assert (completion.finish_reason, completion.stop_reason) == (
                "stop",
                params.stop_token_ids[0],
            )
        else:
            assert completion.finish_reason == "length"


def count_cut_runs(monkeypatch) -> list[int]:
    """Counts (in the returned one-item list) the steps whose verified tokens were cut short
    by a stop: a stop token inside a run of accepted drafts."""
    num_cut = [0]
    append_tokens = scheduler_module.append_tokens

    def counting_append_tokens(request, token_ids, max_model_len):
        before = request.num_output_tokens
        status = append_tokens(request, token_ids, max_model_len)
        num_cut[0] += request.num_output_tokens - before < len(token_ids)
        return status

    monkeypatch.setattr(scheduler_module, "append_tokens", counting_append_tokens)
    return num_cut


# ---- the default model --------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_outputs_equal_without_speculation(monkeypatch) -> None:
    from engine import LLM
    from engine.layers.quant_select import QUANT_ROUTE_ENV

    # Exact equality needs numerics that do not depend on a step's row count: the int8 route
    # of the quantized layers (chosen for batched steps, like llama.cpp's) rounds a verify
    # step's rows differently from a one-row decode step, so the route is held at fp32 here
    # (tests/engine/models/test_int8_route.py checks the int8 route by the top-5 criterion).
    monkeypatch.setenv(QUANT_ROUTE_ENV, "fp32")
    kwargs = dict(kv_cache_memory_bytes=256 * 2**20, max_num_batched_tokens=256)
    plain = LLM(**kwargs)
    spec = LLM(speculative_config=NGRAM, **kwargs)
    tokenizer = plain.get_tokenizer()
    texts = [
        "The quick brown fox jumps over the lazy dog. " * 4 + "The quick",
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(",
        "The capital of France is",
        "Once upon a time, in a small workshop at the edge of a quiet town, there lived",
    ]
    prompts = [tokenizer(t).input_ids for t in texts]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    expected = plain.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)

    # Plain greedy requests, plus each distinct token of the repeating output as a stop
    # token, plus a sampled and a logprobs request riding in the same batches.
    cases: list[tuple[list[int], SamplingParams, list[int]]] = [
        (p, greedy, list(o.outputs[0].token_ids)) for p, o in zip(prompts, expected)
    ]
    tokens = cases[0][2]
    firsts = {t: i for i, t in reversed(list(enumerate(tokens)))}
    for t, i in firsts.items():
        params = SamplingParams(temperature=0.0, max_tokens=48, stop_token_ids=[t])
        cases.append((prompts[0], params, tokens[: i + 1]))
    num_cut = count_cut_runs(monkeypatch)
    engine = spec.llm_engine
    outputs = spec.generate(
        [{"prompt_token_ids": p} for p, _, _ in cases] + [{"prompt_token_ids": prompts[1]}] * 2,
        [params for _, params, _ in cases]
        + [
            SamplingParams(temperature=0.8, seed=1, max_tokens=16),
            SamplingParams(temperature=0.0, max_tokens=16, logprobs=1),
        ],
        use_tqdm=False,
    )
    check_cases(outputs, cases)
    assert outputs[-1].outputs[0].token_ids == expected[1].outputs[0].token_ids[:16]
    scheduler = engine.scheduler
    assert scheduler.num_accepted_draft_tokens > 0.2 * scheduler.num_draft_tokens > 0
    assert num_cut[0] > 0, "no stop token fell inside an accepted draft run"
    assert engine.kv_cache_manager.get_num_free_blocks() == engine.get_cache_config().num_blocks
