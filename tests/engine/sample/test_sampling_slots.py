"""The persistent per-slot sampling state (engine/sample/sampling_slots.py): the tensors it
gathers equal those `SamplingMetadata.build` makes from the rows, through joins, leaves,
reorders, growth and positions that move; and it copies to the device only when a slot was
written. The GPU's pinned path runs with a stand-in pin that records what goes up."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import SamplingParams
from engine.sample import Sampler, SamplingMetadata, SamplingRow
from engine.sample.metadata import add_row_features
from engine.sample.penalties import apply_penalties
from engine.sample.sampling_slots import SamplingSlots, SlotRow, counts_penalties_on_device

_VOCAB = 40
_CPU = torch.device("cpu")

_PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=3),
    "top-k": SamplingParams(temperature=1.2, top_k=5, min_p=0.05, seed=1),
    "big-k": SamplingParams(temperature=0.5, top_k=_VOCAB + 3, seed=2),  # off: >= vocab
    "penalised": SamplingParams(
        temperature=0.7, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3
    ),
    "logprobs": SamplingParams(temperature=0.0, logprobs=3, top_k=7),  # greedy: filters off
}


def _token(seed: int, i: int) -> int:
    """The i-th output token of a row (a repeat every few tokens, for the counts)."""
    return (7 * (i % 5) + seed) % _VOCAB


def _row(name: str, seed: int, outputs: int, placeholders: int = 0) -> SamplingRow:
    return SamplingRow(
        params=_PARAMS[name.split("#")[0]],
        prompt_token_ids=[1, 5, 5, 9],
        output_token_ids=[_token(seed, i) for i in range(outputs)],
        seed=seed,
        num_output_placeholders=placeholders,
    )


def _sampled(rows: list[SamplingRow]) -> torch.Tensor:
    """What each row samples next: the token `_row` lists at that place next step."""
    return torch.tensor([_token(r.seed, len(r.output_token_ids)) for r in rows])


def _slot_rows(names: list[str], rows: list[SamplingRow]) -> list[SlotRow]:
    return [
        (
            name, r.params, r.seed, len(r.output_token_ids) + r.num_output_placeholders,
            r.prompt_token_ids, r.output_token_ids,
        )
        for name, r in zip(names, rows)
    ]  # fmt: skip


_SPARSE = {
    "output_row_ids", "output_token_ids", "output_token_counts", "seen_row_ids",
    "seen_token_ids", "penalty_row_ids", "penalty_counts", "penalty_prompt_mask",
}  # fmt: skip


def _assert_same_metadata(got: SamplingMetadata, expected: SamplingMetadata) -> None:
    """Every field equal, but the penalties' tokens: the device's dense rows against the
    rebuilt sparse lists, compared by what they do to logits (bit for bit)."""
    logits = torch.randn(got.num_rows, _VOCAB, generator=torch.Generator().manual_seed(1))
    logits[:, 3] = -logits[:, 3].abs()  # negative logits too, for the repetition penalty
    assert torch.equal(apply_penalties(logits, got), apply_penalties(logits, expected))
    for f in dataclasses.fields(SamplingMetadata):
        if f.name in _SPARSE:
            continue
        a, b = getattr(got, f.name), getattr(expected, f.name)
        if isinstance(b, torch.Tensor) or isinstance(a, torch.Tensor):
            assert a is not None and b is not None, f.name
            assert a.dtype == b.dtype and torch.equal(a, b), (f.name, a, b)
        else:
            assert a == b, (f.name, a, b)


def _check(slots: SamplingSlots, names: list[str], rows: list[SamplingRow]) -> None:
    metadata, needs_rows = slots.metadata(_slot_rows(names, rows), _VOCAB)
    if needs_rows:
        add_row_features(metadata, rows, _CPU)
    _assert_same_metadata(metadata, SamplingMetadata.build(rows, _VOCAB, _CPU))
    penalised = [i for i, r in enumerate(rows) if r.params.presence_penalty]
    # Penalties counted on the device need no rows; on the CPU they are built from them.
    assert needs_rows == bool(penalised and not slots.penalties_on_device)
    if penalised and slots.penalties_on_device:
        assert metadata.penalty_row_ids is not None
        assert metadata.penalty_row_ids.tolist() == penalised


@pytest.mark.parametrize("on_device", [True, False], ids=["penalties-on-device", "cpu-default"])
def test_gathered_tensors_equal_the_rebuilt_ones_through_joins_leaves_and_growth(
    on_device: bool,
) -> None:
    slots = SamplingSlots(_CPU, capacity=2, penalties_on_device=on_device)
    outputs = {name: 0 for name in ("seeded", "greedy", "top-k", "big-k", "penalised", "logprobs")}
    seeds = {name: 10 + i for i, name in enumerate(outputs)}
    seeds["seeded"] = 2**64 - 5  # wraps to a negative int64, as build does
    batches = [
        ["seeded", "greedy"],
        ["seeded", "greedy", "top-k", "big-k"],  # grows past 2 slots
        ["top-k", "seeded", "penalised", "logprobs", "big-k"],  # reordered; greedy left
        ["logprobs", "greedy"],  # greedy back: a new slot, its position from the host
        ["greedy", "logprobs", "seeded"],
    ]
    for names in batches:
        rows = [_row(n, seeds[n], outputs[n]) for n in names]
        _check(slots, names, rows)
        slots.advance(_sampled(rows))
        for n in names:
            outputs[n] += 1
        slots.drop(set(outputs) - set(names))


def test_positions_count_placeholders_and_follow_a_reset() -> None:
    slots = SamplingSlots(_CPU)
    names = ["seeded", "top-k"]
    for outputs, placeholders in [(0, 0), (0, 1), (1, 1), (2, 1)]:  # async: one in flight
        rows = [_row(n, 4, outputs, placeholders) for n in names]
        _check(slots, names, rows)
        slots.advance(_sampled(rows))
    uploads = slots.num_uploads
    # A preemption recomputes: the same request samples again from position 1 (its slot
    # kept here, as if its drop came late): the host sees the moved position and writes it.
    _check(slots, names, [_row("seeded", 4, 1), _row("top-k", 4, 3, 1)])
    assert slots.num_uploads == uploads + 1


def _recording_pin(log: list[int]):
    def pin(tensor: torch.Tensor) -> torch.Tensor:
        log.append(tensor.numel())
        return tensor.clone()  # pinning copies

    return pin


def test_a_steady_batch_uploads_nothing_and_a_join_uploads_once() -> None:
    pinned: list[int] = []
    slots = SamplingSlots(_CPU, pin=_recording_pin(pinned), capacity=4, penalties_on_device=True)
    names = ["seeded", "top-k", "penalised"]
    for step in range(4):
        rows = [_row(n, 1, step) for n in names]
        _check(slots, names, rows)
        slots.advance(_sampled(rows))
        if step == 0:  # the buffer, the index, the penalised row's tokens and indices
            assert slots.num_uploads == 1 and len(pinned) == 5
    assert slots.num_uploads == 1 and len(pinned) == 5  # steady: nothing went up
    names = ["seeded", "top-k", "penalised", "greedy"]  # a join
    _check(slots, names, [_row(n, 1, 4 if n != "greedy" else 0) for n in names])
    assert slots.num_uploads == 2 and len(pinned) == 9  # buffer, the new indices (3)
    # The device buffer holds the host's bytes (what the pinned copy carried).
    assert torch.equal(slots._device, torch.from_numpy(slots._host))


def test_a_changed_parameter_object_is_written_again() -> None:
    slots = SamplingSlots(_CPU)
    row = _row("seeded", 1, 0)
    _check(slots, ["a"], [row])
    slots.advance(_sampled([row]))
    hotter = dataclasses.replace(row, params=SamplingParams(temperature=1.5, seed=3))
    hotter.output_token_ids = [0]
    _check(slots, ["a"], [hotter])


def test_the_sampler_draws_the_same_tokens_from_slots() -> None:
    generator = torch.Generator().manual_seed(0)
    names = ["seeded", "top-k", "big-k", "greedy", "penalised#2"]
    slots = SamplingSlots(_CPU, capacity=1, penalties_on_device=True)
    sampler = Sampler()
    for step in range(3):
        rows = [_row(n, 5 + i, step) for i, n in enumerate(names)]
        logits = torch.randn(len(rows), _VOCAB, generator=generator)
        metadata, needs_rows = slots.metadata(_slot_rows(names, rows), _VOCAB)
        assert not needs_rows
        add_row_features(metadata, rows, _CPU)
        got = sampler(logits.clone(), metadata).sampled_token_ids
        slots.advance(_sampled(rows))
        expected = sampler(logits.clone(), SamplingMetadata.build(rows, _VOCAB, _CPU))
        assert torch.equal(got, expected.sampled_token_ids)


def test_advance_needs_a_gather() -> None:
    with pytest.raises(AssertionError, match="metadata"):
        SamplingSlots(_CPU).advance(torch.zeros(1, dtype=torch.int64))


def test_penalty_counts_follow_the_sampled_tokens_and_are_rebuilt_after_a_reset() -> None:
    """The device's counts are the rows' output counts step after step (the rebuild's lists
    say so, by _check); a moved position rebuilds them from the host's lists, which must be
    complete then."""
    slots = SamplingSlots(_CPU, capacity=1, penalties_on_device=True)
    names = ["penalised", "penalised#b", "seeded"]
    seeds = {"penalised": 3, "penalised#b": 8, "seeded": 1}
    for step in range(7):  # _token repeats every 5: counts reach 2
        rows = [_row(n, seeds[n], step) for n in names]
        _check(slots, names, rows)
        slots.advance(_sampled(rows))
    assert slots.penalties is not None and int(slots.penalties.counts.max()) == 2
    rows = [_row(n, seeds[n], 2) for n in names]  # preempted and recomputed from 2 tokens
    _check(slots, names, rows)
    slots.advance(_sampled(rows))
    with pytest.raises(RuntimeError, match=r"'penalised'.*in flight"):
        slots.metadata(_slot_rows(names, [_row(n, seeds[n], 1, 1) for n in names]), _VOCAB)
    slots.drop({"penalised", "penalised#b"})
    assert slots.penalties.row(0) is None and slots.penalties.row(1) is None


def test_penalties_are_counted_on_the_device_off_the_cpu() -> None:
    assert counts_penalties_on_device("cuda") and counts_penalties_on_device("cuda:1")
    assert not counts_penalties_on_device(_CPU)
    assert not SamplingSlots(_CPU).penalties_on_device  # the default follows the device
