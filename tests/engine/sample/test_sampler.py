"""Sampler tests: greedy, temperature, filters, penalties, min_tokens, seeding, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.api.sampling_params import SamplingParams
from engine.sample import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    SamplingRow,
    compute_logprobs,
    gather_logprobs,
    uniform,
)
from engine.sample.filters import apply_min_p, apply_top_k_top_p
from engine.sample.penalties import apply_penalties
from engine.sample.sampler import sample_inverse_cdf

EOS = 2


def make_row(
    seed: int = 0,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    **params: object,
) -> SamplingRow:
    sampling_params = SamplingParams(**params)  # type: ignore[arg-type]
    sampling_params.update_from_generation_config({EOS})
    return SamplingRow(sampling_params, list(prompt or [1]), list(output or []), seed)


def sample(logits: torch.Tensor, rows: list[SamplingRow]):
    metadata = SamplingMetadata.build(rows, logits.shape[-1], logits.device)
    return Sampler()(logits, metadata)


def randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def chi_square(token_ids: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson statistic of observed token counts against expected probabilities."""
    counts = torch.bincount(token_ids, minlength=probs.numel()).double()
    expected = probs.double() * token_ids.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# ---- greedy ---------------------------------------------------------------------------------


def test_greedy_equals_argmax_with_ties_to_lowest_id() -> None:
    logits = randn(6, 1000)
    logits[0, 9] = logits[0, 5] = logits[0].max() + 1.0  # tie: argmax picks id 5
    out = sample(logits, [make_row(seed=i, temperature=0.0) for i in range(6)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids[0] == 5
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None


def test_greedy_rows_in_a_mixed_batch() -> None:
    logits = randn(8, 500, scale=2.0)
    rows = [
        make_row(seed=i, temperature=0.0 if i % 2 else 1.0, top_p=0.9 if i % 4 == 0 else 1.0)
        for i in range(8)
    ]
    sampled = sample(logits, rows).sampled_token_ids
    assert torch.equal(sampled[1::2], logits[1::2].argmax(-1))


# ---- temperature and the inverse CDF -------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax(temperature: float) -> None:
    logits = torch.tensor([1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -0.5, 0.25])
    num_draws = 12_000
    # Half the draws vary the seed, half the position: both must be well spread.
    rows = [make_row(seed=i, temperature=temperature) for i in range(num_draws // 2)]
    rows += [make_row(seed=8, temperature=temperature) for _ in range(num_draws // 2)]
    metadata = SamplingMetadata.build(rows, logits.numel(), "cpu")
    # Positions as if the second half were one request's outputs 0, 1, 2, ...
    metadata.positions[num_draws // 2 :] = torch.arange(num_draws // 2)
    sampled = Sampler()(logits.expand(num_draws, -1), metadata).sampled_token_ids
    # 7 degrees of freedom: P(chi2 > 40) ~ 1e-6. The draws are deterministic, so this
    # checks once and for all that the counter-based draws follow the distribution.
    assert chi_square(sampled, torch.softmax(logits / temperature, -1)) < 40.0


def test_inverse_cdf_never_samples_zero_probability() -> None:
    probs = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.5, 0.0]]).expand(4, -1).contiguous()
    u = torch.tensor([0.0, 0.5 - 1e-12, 0.5, 1.0 - 2.0**-53], dtype=torch.float64)
    assert sample_inverse_cdf(probs, u).tolist() == [2, 2, 4, 4]
    # Unnormalised mass and a u that rounds u * total up to total stay inside the row.
    probs = torch.tensor([[0.3, 0.0, 0.0]]) * 3.0
    assert sample_inverse_cdf(probs, torch.tensor([1.0 - 2.0**-53], dtype=torch.float64)) == 0


def test_inverse_cdf_follows_probabilities_across_blocks() -> None:
    # Stratified u = (i + 1/2) / N: token t must be drawn N * p[t] times, give or take one
    # (two for float rounding), over a vocabulary of several 256-token blocks with a tail.
    vocab_size, num_draws = 1000, 20_000
    probs = randn(vocab_size, seed=14).softmax(-1)
    probs[100:300] = 0.0  # a whole block and parts of two more
    probs[999] = 0.0
    u = (torch.arange(num_draws, dtype=torch.float64) + 0.5) / num_draws
    sampled = sample_inverse_cdf(probs.expand(num_draws, -1), u)
    counts = torch.bincount(sampled, minlength=vocab_size).double()
    expected = probs.double() / probs.double().sum() * num_draws
    assert (counts - expected).abs().max() <= 2.0
    assert counts[probs == 0].sum() == 0


# ---- top-k / top-p / min-p -----------------------------------------------------------------


def reference_support(
    probs: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> set[int]:
    """Tokens a row may sample, by the definitions, one row at a time in float64."""
    p = probs.double()
    order = torch.argsort(p, descending=True, stable=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    if top_p < 1.0:
        kept = p[order] / p[order].sum()
        mass, size = 0.0, 0
        while mass < top_p and size < len(order):
            mass += float(kept[size])
            size += 1
        order = order[:size]
    largest = float(p.max())
    return {t for t in order if float(p[t]) >= min_p * largest and float(p[t]) > 0}


def test_top_k_top_p_min_p_match_reference_per_row() -> None:
    settings = [
        (0, 1.0, 0.0),
        (5, 1.0, 0.0),
        (0, 0.7, 0.0),
        (20, 0.5, 0.0),
        (1, 1.0, 0.0),
        (0, 1.0, 0.1),
        (10, 0.9, 0.2),
        (0, 0.95, 0.0),
        (0, 0.05, 0.0),
    ]
    probs = randn(len(settings), 300, seed=1, scale=2.0).softmax(-1)
    top_k = torch.tensor([s[0] for s in settings])
    top_p = torch.tensor([s[1] for s in settings])
    min_p = torch.tensor([s[2] for s in settings])
    filtered = apply_min_p(apply_top_k_top_p(probs.clone(), top_k, top_p, int(top_k.max())), min_p)
    for row, (k, p, m) in enumerate(settings):
        assert set(filtered[row].nonzero().flatten().tolist()) == reference_support(
            probs[row], k, p, m
        ), settings[row]
        kept = filtered[row] > 0
        assert torch.equal(filtered[row][kept], probs[row][kept])  # survivors untouched


def test_top_k_alone_and_filters_off_leave_rows_untouched() -> None:
    probs = randn(3, 100, seed=2).softmax(-1)
    filtered = apply_top_k_top_p(probs.clone(), torch.tensor([3, 0, 99]), None, 99)
    assert (filtered[0] > 0).sum() == 3
    assert torch.equal(filtered[1], probs[1])
    assert (filtered[2] > 0).sum() == 99
    assert apply_top_k_top_p(probs, None, None, 0) is probs
    assert apply_min_p(probs, None) is probs


def test_top_p_large_nucleus_on_a_large_vocab() -> None:
    # Flat rows have nuclei far beyond the CPU's first prefixes (256, 4096), forcing the
    # full sort; peaked rows fit in the first prefix. Every row must give the same cutoff
    # alone as in the batch, whichever prefix the batch needed.
    vocab_size = 49152
    logits = randn(4, vocab_size, seed=3)
    logits[1] *= 0.05  # nearly flat
    logits[2] *= 8.0  # peaked
    probs = logits.softmax(-1)
    top_p = torch.tensor([0.9, 0.8, 0.9, 1.0])
    filtered = apply_top_k_top_p(probs.clone(), None, top_p, 0)
    for row in range(4):
        alone = apply_top_k_top_p(probs[row : row + 1].clone(), None, top_p[row : row + 1], 0)
        assert torch.equal(alone[0], filtered[row])
    assert (filtered[1] > 0).sum() > 30_000
    assert torch.equal(filtered[3], probs[3])
    for row in (0, 1, 2):
        kept = filtered[row] > 0
        # the smallest nucleus: mass reaches top_p, and not without its least likely token
        mass = probs[row][kept].double().sum()
        assert mass >= top_p[row] - 1e-6
        assert mass - probs[row][kept].min() < top_p[row] + 1e-6


def test_sampler_top_k_keeps_only_k_tokens() -> None:
    logits = randn(64, seed=4, scale=1.5)
    rows = [make_row(seed=i, top_k=5) for i in range(3000)]
    sampled = sample(logits.expand(len(rows), -1).contiguous(), rows).sampled_token_ids
    assert set(sampled.tolist()) == set(logits.topk(5).indices.tolist())


def test_sampler_top_p_samples_the_nucleus_in_proportion() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = [make_row(seed=i, top_p=0.75) for i in range(4000)]
    logits = probs.log().expand(len(rows), -1).contiguous()
    sampled = sample(logits, rows).sampled_token_ids
    # nucleus {0, 1} (mass 0.8 is the first to reach 0.75), renormalised to 5/8, 3/8
    assert chi_square(sampled, torch.tensor([0.625, 0.375, 0.0, 0.0])) < 30.0


def test_sampler_min_p() -> None:
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    rows = [make_row(seed=i, min_p=0.3) for i in range(4000)]  # keeps p >= 0.12
    logits = probs.log().expand(len(rows), -1).contiguous()
    sampled = sample(logits, rows).sampled_token_ids
    assert chi_square(sampled, torch.tensor([0.4, 0.3, 0.15, 0.0, 0.0]) / 0.85) < 30.0


# ---- penalties and min_tokens ---------------------------------------------------------------


def reference_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    out = logits.clone()
    for i, row in enumerate(rows):
        params = row.params
        for token in set(row.prompt_token_ids) | set(row.output_token_ids):
            value = float(out[i, token])
            rp = params.repetition_penalty
            out[i, token] = value / rp if value > 0 else value * rp
        for token in set(row.output_token_ids):
            count = row.output_token_ids.count(token)
            out[i, token] -= params.frequency_penalty * count + params.presence_penalty
    return out


def test_penalties_match_reference() -> None:
    vocab_size = 50
    rows = [
        make_row(prompt=[1, 3, 3, 40], output=[3, 5, 5, 5, 7], repetition_penalty=1.3),
        make_row(prompt=[2], output=[8, 8, 9], frequency_penalty=0.7, temperature=0.0),
        make_row(prompt=[4, 8], output=[8, 8, 49], presence_penalty=-1.5),
        make_row(
            prompt=[10, 11],
            output=[10, 12, 12],
            repetition_penalty=0.8,
            frequency_penalty=-0.4,
            presence_penalty=2.0,
        ),
        make_row(prompt=[1, 2, 3], output=[4, 4]),  # no penalty
        make_row(prompt=[5], output=[]),  # no output yet
    ]
    logits = randn(len(rows), vocab_size, seed=5, scale=3.0)
    metadata = SamplingMetadata.build(rows, vocab_size, "cpu")
    expected = reference_penalties(logits, rows)
    torch.testing.assert_close(apply_penalties(logits, metadata), expected)
    assert torch.equal(apply_penalties(logits, metadata)[4:], logits[4:])  # untouched
    # Greedy sampling sees the penalised logits.
    greedy_rows = [
        make_row(
            prompt=r.prompt_token_ids,
            output=r.output_token_ids,
            temperature=0.0,
            repetition_penalty=r.params.repetition_penalty,
            frequency_penalty=r.params.frequency_penalty,
            presence_penalty=r.params.presence_penalty,
        )
        for r in rows
    ]
    assert torch.equal(sample(logits, greedy_rows).sampled_token_ids, expected.argmax(-1))


def test_unused_features_build_no_tensors() -> None:
    metadata = SamplingMetadata.build([make_row(), make_row(temperature=0.0)], 100, "cpu")
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    assert metadata.output_token_counts is None and metadata.seen_token_ids is None
    assert metadata.presence_penalties is None and metadata.repetition_penalties is None
    assert metadata.min_tokens_row_ids is None and metadata.max_num_logprobs is None
    assert not metadata.all_greedy and not metadata.all_random
    # top_k >= vocab is no filter; greedy rows never filter.
    metadata = SamplingMetadata.build(
        [make_row(top_k=100), make_row(temperature=0.0, top_k=5, top_p=0.5)], 100, "cpu"
    )
    assert metadata.top_k is None and metadata.top_p is None


def test_metadata_penalty_tokens_and_positions() -> None:
    rows = [
        make_row(seed=-1, prompt=[1, 1, 4], output=[9, 2, 2, 2], frequency_penalty=0.5),
        make_row(seed=2**64 + 5, prompt=[3, 7], output=[7, 0], repetition_penalty=1.2),
        make_row(seed=3, prompt=[5], output=[5, 6]),  # no penalty: not listed
    ]
    metadata = SamplingMetadata.build(rows, 10, "cpu")
    assert metadata.positions.tolist() == [4, 2, 2]
    assert metadata.seeds.tolist() == [-1, 5, 3]
    assert metadata.output_row_ids is not None and metadata.output_token_ids is not None
    assert metadata.output_token_counts is not None
    assert metadata.output_row_ids.tolist() == [0, 0]
    assert metadata.output_token_ids.tolist() == [2, 9]
    assert metadata.output_token_counts.tolist() == [3.0, 1.0]
    assert metadata.seen_row_ids is not None and metadata.seen_token_ids is not None
    assert metadata.seen_row_ids.tolist() == [1, 1, 1]
    assert metadata.seen_token_ids.tolist() == [0, 3, 7]
    assert metadata.presence_penalties is None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_stop_and_eos_until_reached(temperature: float) -> None:
    vocab_size = 20
    logits = torch.zeros(vocab_size)
    logits[EOS], logits[7], logits[11] = 30.0, 29.0, 28.0  # EOS, then stop id 7, then 11

    def row(num_output: int, **params: object) -> SamplingRow:
        return make_row(
            seed=num_output,
            output=[5] * num_output,
            temperature=temperature,
            stop_token_ids=[7],
            **params,
        )

    rows = [
        row(0, min_tokens=3),
        row(2, min_tokens=3),
        row(3, min_tokens=3),
        row(0),
        row(1, min_tokens=2, ignore_eos=True),
    ]
    sampled = sample(logits.expand(len(rows), -1).contiguous(), rows).sampled_token_ids
    # With ignore_eos, EOS does not stop the request, so min_tokens does not ban it (vLLM).
    assert sampled.tolist() == [11, 11, EOS, EOS, EOS]


# ---- seeding: the same (seed, position) gives the same token in any batch --------------------


def test_same_seed_and_position_give_same_token_whatever_the_batch() -> None:
    vocab_size = 1000
    params = [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=50),
        dict(top_p=0.9),
        dict(min_p=0.05, temperature=1.3),
        dict(top_k=200, top_p=0.8, min_p=0.01),
        dict(temperature=1.0, repetition_penalty=1.1),
    ]
    rows = [make_row(seed=100 + i, output=[3] * i, **p) for i, p in enumerate(params)]
    logits = randn(len(rows), vocab_size, seed=6, scale=1.5)
    first = sample(logits, rows).sampled_token_ids

    # Shuffled, and mixed with rows that use other features (penalties, greedy, logprobs,
    # min_tokens, other filters): every original row samples the same token.
    extra = [
        make_row(seed=1, temperature=0.0, presence_penalty=1.0, output=[4, 4]),
        make_row(seed=2, top_k=3, frequency_penalty=0.5, logprobs=3),
        make_row(seed=3, top_p=0.5, min_tokens=5, repetition_penalty=1.5),
    ]
    extra_logits = randn(len(extra), vocab_size, seed=7)
    order = torch.randperm(len(rows) + len(extra), generator=torch.Generator().manual_seed(0))
    all_rows = rows + extra
    all_logits = torch.cat([logits, extra_logits])
    mixed = sample(all_logits[order], [all_rows[i] for i in order.tolist()]).sampled_token_ids
    back = torch.empty_like(mixed)
    back[order] = mixed
    assert torch.equal(back[: len(rows)], first)
    for i, row in enumerate(rows):  # and one row at a time
        assert torch.equal(sample(logits[i : i + 1], [row]).sampled_token_ids, first[i : i + 1])


def test_different_seeds_and_positions_differ() -> None:
    logits = torch.zeros(1, 1000)  # uniform over 1000 tokens
    by_seed = sample(logits.expand(100, -1), [make_row(seed=s) for s in range(100)])
    by_position = sample(
        logits.expand(100, -1), [make_row(seed=0, output=[1] * p) for p in range(100)]
    )
    assert len(set(by_seed.sampled_token_ids.tolist())) > 90
    assert len(set(by_position.sampled_token_ids.tolist())) > 90


# ---- the counter-based generator -----------------------------------------------------------


def test_uniform_range_moments_and_purity() -> None:
    n = 40_000
    seeds = torch.arange(n, dtype=torch.int64) * 7919 - 1000
    positions = torch.arange(n, dtype=torch.int64) % 977
    u = uniform(seeds, positions)
    assert u.dtype == torch.float64
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert abs(float(u.var()) - 1.0 / 12.0) < 0.002
    histogram = torch.histc(u.float(), bins=100, min=0.0, max=1.0)
    assert float(((histogram - n / 100) ** 2 / (n / 100)).sum()) < 180.0  # 99 dof
    # Adjacent positions are uncorrelated.
    a = uniform(torch.full((n,), 42), torch.arange(n))
    assert abs(float(torch.corrcoef(torch.stack([a[:-1], a[1:]]))[0, 1])) < 0.01
    # Pure: element i depends only on (seeds[i], positions[i]).
    subset = torch.tensor([5, 0, 38_765, 7])
    assert torch.equal(uniform(seeds[subset], positions[subset]), u[subset])


def test_uniform_extreme_seeds_and_fixed_values() -> None:
    seeds = torch.tensor([0, -1, 2**63 - 1, -(2**63), 1, 1], dtype=torch.int64)
    positions = torch.tensor([0, 0, 0, 0, 2**40, 2**40 + 1], dtype=torch.int64)
    u = uniform(seeds, positions)
    assert ((u >= 0) & (u < 1)).all() and len(set(u.tolist())) == 6
    # Pinned values: a change here changes every seeded request's output.
    pinned = uniform(torch.tensor([0, 1, 12345]), torch.tensor([0, 0, 7]))
    assert pinned.tolist() == pytest.approx(PINNED_UNIFORMS, abs=0.0)


PINNED_UNIFORMS = [0.08045989333538928, 0.8646740510207142, 0.9003334658450319]


# ---- logprobs --------------------------------------------------------------------------------


def test_logprobs_are_raw_and_ranked() -> None:
    vocab_size = 300
    logits = randn(5, vocab_size, seed=8, scale=2.0)
    rows = [
        make_row(
            seed=0,
            logprobs=3,
            temperature=0.5,
            repetition_penalty=1.5,
            output=[int(logits[0].argmax())],
        ),
        make_row(seed=1, logprobs=0, temperature=0.0),
        make_row(seed=2, logprobs=5, top_p=0.5),
        make_row(seed=3, temperature=1.0),
        make_row(seed=4, logprobs=1, min_tokens=2, temperature=0.0),
    ]
    out = sample(logits, rows)
    assert out.logprobs is not None
    reference = torch.log_softmax(logits.double(), -1).float()
    sampled = out.sampled_token_ids
    assert out.logprobs.token_ids.shape == (5, 6) and out.logprobs.logprobs.shape == (5, 6)
    assert torch.equal(out.logprobs.token_ids[:, 0], sampled)
    torch.testing.assert_close(
        out.logprobs.logprobs[:, 0], reference.gather(1, sampled[:, None])[:, 0]
    )
    top = reference.topk(5, dim=-1)
    assert torch.equal(out.logprobs.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs.logprobs[:, 1:], top.values)
    ranks = [int((reference[i] > reference[i, sampled[i]]).sum()) + 1 for i in range(5)]
    assert out.logprobs.ranks.tolist() == ranks
    assert out.logprobs.ranks[1] == 1  # greedy without penalties: the most likely token


def test_gather_logprobs_for_prompt_positions() -> None:
    logits = randn(7, 40, seed=9)
    next_ids = torch.tensor([3, 0, 39, 5, 5, 12, 1])
    logprobs = compute_logprobs(logits)
    result = gather_logprobs(logprobs, next_ids, 0)
    assert isinstance(result, LogprobsTensors)
    assert result.token_ids.shape == (7, 1)
    torch.testing.assert_close(result.logprobs[:, 0], logprobs[torch.arange(7), next_ids])
    assert gather_logprobs(logprobs, next_ids, 100).token_ids.shape == (7, 41)  # k capped
    tied = torch.log_softmax(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), -1)
    assert gather_logprobs(tied, torch.tensor([2]), 2).ranks.tolist() == [1]
    assert gather_logprobs(tied, torch.tensor([3]), 2).ranks.tolist() == [4]


# ---- shapes: B = 1 and the real vocabulary ---------------------------------------------------


def test_batch_of_one_and_large_vocab() -> None:
    vocab_size = 49152
    logits = randn(1, vocab_size, seed=10, scale=4.0)
    for params, check in [
        (dict(temperature=0.0), lambda t: t == int(logits.argmax())),
        (dict(top_k=20), lambda t: t in set(logits[0].topk(20).indices.tolist())),
        (dict(top_p=0.5, logprobs=2), lambda t: float(logits[0, t]) > float(logits.mean())),
        (dict(temperature=0.8, repetition_penalty=1.2, min_tokens=1), lambda t: t != EOS),
    ]:
        row = make_row(seed=11, prompt=list(range(0, 4000, 3)), **params)
        out = sample(logits, [row])
        assert out.sampled_token_ids.shape == (1,)
        assert check(int(out.sampled_token_ids[0])), params
    big = sample(
        randn(16, vocab_size, seed=12), [make_row(seed=i, top_p=0.9, top_k=1000) for i in range(16)]
    )
    assert big.sampled_token_ids.shape == (16,) and (big.sampled_token_ids < vocab_size).all()


def test_sampler_does_not_modify_logits() -> None:
    logits = randn(3, 30, seed=13)
    before = logits.clone()
    rows = [
        make_row(output=[1, 2], repetition_penalty=2.0, min_tokens=5),
        make_row(temperature=0.0, frequency_penalty=1.0, output=[4]),
        make_row(top_p=0.5, logprobs=2),
    ]
    sample(logits, rows)
    assert torch.equal(logits, before)
    assert math.isfinite(float(logits.sum()))


def test_argmax_implementations_agree_and_are_chosen_from_the_ops():
    from engine import native
    from engine.sample.sampler import native_argmax, select_argmax, torch_argmax

    assert select_argmax("torch") is torch_argmax
    assert select_argmax("triton") is torch_argmax
    assert select_argmax("native") is native_argmax
    if not native.native_kernels_available():
        pytest.skip("native CPU kernels unavailable (no C compiler)")
    logits = randn(9, 1001, seed=3)
    logits[2, 5] = logits[2, 700] = logits[2].max() + 1.0  # a tie: the lower id wins
    logits[4] = 0.0  # an all-equal row
    rows = [make_row(seed=i, temperature=0.0) for i in range(9)]
    metadata = SamplingMetadata.build(rows, logits.shape[-1], logits.device)
    greedy_native = Sampler(native_argmax)(logits.clone(), metadata).sampled_token_ids
    greedy_torch = Sampler(torch_argmax)(logits.clone(), metadata).sampled_token_ids
    assert torch.equal(greedy_native, greedy_torch)
    assert greedy_native[2] == 5 and greedy_native[4] == 0
    # Non-contiguous logits are accepted (a column slice of a wider tensor).
    wide = torch.cat([logits, logits], dim=1)[:, :1001]
    assert torch.equal(native_argmax(wide), torch_argmax(logits))
