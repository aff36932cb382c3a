"""The runner's sampling parameters kept in per-slot tensors (engine/sample/sampling_slots.py)
against today's rebuild of every tensor from the rows each step (`SamplingMetadata.build`):
the same tokens and logprobs, with preemption, aborts, chunked prefill, n > 1, penalties,
LoRA and structured outputs, async scheduling on and off. And the transfers of a steady
seeded decode step on the GPU's path (pinned uploads, forced on the CPU): nothing uploaded
for the sampler, no blocking upload at all, one read."""

from __future__ import annotations

import collections
import dataclasses
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.sample import SamplingMetadata, sampling_slots
from engine.worker import host_reads
from engine.worker.step_sampler import StepSampler, sampling_row
from engine.worker.uploads import Uploader
from tests.engine.front.test_async_scheduling import (
    Workload,
    _prompt,
    assert_same,
    num_overlapped,
    run,
)
from tests.model_utils import make_tiny_llama


def _rebuild_each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler gets today's tensors, rebuilt from the rows (the slots still run, so
    their state moves as it would)."""
    original = StepSampler._metadata

    def rebuilt(self: StepSampler, entries: list[Any], vocab_size: int) -> SamplingMetadata:
        original(self, entries, vocab_size)
        rows = [sampling_row(e) for e in entries]
        return SamplingMetadata.build(rows, vocab_size, self.runner.device)

    monkeypatch.setattr(StepSampler, "_metadata", rebuilt)


def _slots_vs_rebuilt(
    monkeypatch: pytest.MonkeyPatch, model: Path, async_scheduling: bool, workload: Workload,
    **kwargs: Any,
) -> tuple[Any, Any]:  # fmt: skip
    """The tokens with the slots (async scheduling on or off) against today's rebuild, run
    synchronously: a rebuild reads the output so far from the host, which lacks the tokens
    in flight of penalised rows that now overlap. Synchronous runs agree exactly; with
    async scheduling the batches differ, so logprobs agree to float noise (as sync and
    async runs do, tests/engine/front/test_async_scheduling.py) and an aborted request
    has as many tokens as the steps before its abort gave it."""
    slots = run(model, async_scheduling, workload, **kwargs)
    with monkeypatch.context() as patch:
        _rebuild_each_step(patch)
        rebuilt = run(model, False, workload, **kwargs)
    if not async_scheduling:
        assert slots.outputs == rebuilt.outputs  # token ids, logprobs, finish reasons: exact
        return slots, rebuilt
    aborted = {k for k, v in rebuilt.outputs.items() if v[0][3] == "abort"}
    for request_id in aborted:
        ids, expected = slots.outputs[request_id][0][1], rebuilt.outputs[request_id][0][1]
        assert ids == expected[: len(ids)], request_id

    def finished(result: Any) -> Any:
        kept = {k: v for k, v in result.outputs.items() if k not in aborted}
        return dataclasses.replace(result, outputs=kept)

    assert_same(finished(rebuilt), finished(slots))
    return slots, rebuilt


@pytest.fixture
def penalties_on_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Penalties counted on the device as on a GPU (the CPU rebuilds them from the host's
    tokens by default: `counts_penalties_on_device`), for the runner and the engine's
    async fallback rule alike."""
    monkeypatch.setattr(sampling_slots, "counts_penalties_on_device", lambda device: True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("slots"), vocab_size=256)


def _seeded(**kwargs: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 16, "ignore_eos": True, **kwargs})


@pytest.mark.usefixtures("penalties_on_device")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_same_tokens_with_preemption_aborts_n_and_penalties(
    monkeypatch: pytest.MonkeyPatch, model: Path, async_scheduling: bool
) -> None:
    requests = [
        (0, "filters", _prompt(0, 9), _seeded(temperature=0.9, top_p=0.8, top_k=20, seed=3,
                                              logprobs=2, max_tokens=20)),
        (0, "min-p", _prompt(1, 7), _seeded(temperature=1.1, min_p=0.1, seed=5)),
        (0, "n2", _prompt(2, 5), _seeded(n=2, temperature=1.0, seed=11)),
        (1, "penalised", _prompt(3, 6), _seeded(temperature=0.8, seed=7, presence_penalty=0.6,
                                                frequency_penalty=0.3, repetition_penalty=1.4)),
        (2, "aborted", _prompt(4, 8), _seeded(temperature=0.7, seed=1, max_tokens=30)),
        (3, "greedy", _prompt(5, 12), _seeded(temperature=0.0, max_tokens=14)),
        (4, "min-tokens", _prompt(6, 5), SamplingParams(temperature=0.9, seed=9, min_tokens=6,
                                                        logit_bias={3: 2.0}, max_tokens=12)),
        (6, "late", _prompt(7, 30), _seeded(temperature=0.6, top_k=5, seed=2, max_tokens=10)),
    ]  # fmt: skip
    workload = Workload(requests, aborts={8: ["aborted"]})
    slots, rebuilt = _slots_vs_rebuilt(
        monkeypatch, model, async_scheduling, workload,
        num_gpu_blocks_override=14, block_size=8, max_num_batched_tokens=16,
    )  # fmt: skip
    for result in (slots, rebuilt):
        assert result.engine.scheduler.num_preemptions_total > 0
        assert result.outputs["aborted"][0][3] == "abort"
        assert len(result.outputs["n2"]) == 2
        assert result.outputs["n2"][0][1] != result.outputs["n2"][1][1]  # each its own seed


@pytest.mark.parametrize("on_device", [True, False], ids=["penalties-on-device", "cpu-default"])
def test_penalised_steps_overlap_where_counted_on_the_device(
    monkeypatch: pytest.MonkeyPatch, model: Path, on_device: bool
) -> None:
    """Penalties counted on the device: their steps overlap under async scheduling. On the
    CPU's default they are built from the host's tokens: those steps fall back."""
    if on_device:
        monkeypatch.setattr(sampling_slots, "counts_penalties_on_device", lambda device: True)
    requests = [
        (0, "a", _prompt(0, 6), _seeded(temperature=0.8, seed=1, repetition_penalty=1.5,
                                        frequency_penalty=0.5, max_tokens=12)),
        (1, "b", _prompt(1, 5), _seeded(temperature=0.0, presence_penalty=1.0, max_tokens=12)),
    ]  # fmt: skip
    slots, _ = _slots_vs_rebuilt(monkeypatch, model, True, Workload(requests))
    runner = slots.engine.runner
    assert runner.step_sampler.slots.penalties_on_device == on_device
    assert (runner.step_sampler.slots.penalties is not None) == on_device
    if on_device:
        assert num_overlapped(slots.calls) >= 10
    else:
        assert num_overlapped(slots.calls) <= 1  # the first step (prompts) only


@pytest.mark.usefixtures("penalties_on_device")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_same_tokens_with_lora(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model: Path, async_scheduling: bool
) -> None:
    from tests.lora_utils import make_peft_adapter

    make_peft_adapter(
        model, tmp_path / "lora", rank=4, alpha=8, targets=["q_proj", "v_proj"], seed=1
    )
    lora = LoRARequest("a", 1, str(tmp_path / "lora"))
    requests = [
        (0, "base", _prompt(0, 7), _seeded(temperature=0.9, top_p=0.9, seed=4, max_tokens=8)),
        (0, "lora", _prompt(0, 7), _seeded(temperature=0.9, top_p=0.9, seed=4, max_tokens=8),
         lora),
        (1, "lora-penalised", _prompt(2, 6), _seeded(temperature=0.7, seed=6, max_tokens=8,
                                                     repetition_penalty=1.3), lora),
    ]  # fmt: skip
    slots, _ = _slots_vs_rebuilt(
        monkeypatch, model, async_scheduling, Workload(requests),
        enable_lora=True, max_lora_rank=8,
    )  # fmt: skip
    assert slots.outputs["base"][0][1] != slots.outputs["lora"][0][1]  # the adapter acts


def test_same_tokens_with_structured_outputs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A constrained seeded row beside plain seeded ones (their steps run synchronously under
    async scheduling too: the bitmask follows the sampled token)."""
    from engine.structured_output import StructuredOutputsParams

    model = make_tiny_llama(tmp_path / "tok", with_tokenizer=True, num_layers=1)
    regex = StructuredOutputsParams(regex=r"[a-c ]{4,12}")
    requests = [
        (0, "plain", _prompt(0, 7), _seeded(temperature=0.9, top_p=0.9, seed=4, max_tokens=8)),
        (0, "regex", _prompt(1, 6), SamplingParams(temperature=0.8, seed=4, max_tokens=12,
                                                   structured_outputs=regex)),
    ]  # fmt: skip
    slots, _ = _slots_vs_rebuilt(
        monkeypatch, model, False, Workload(requests), skip_tokenizer_init=False
    )
    assert slots.outputs["regex"][0][3] == "stop"  # the grammar ended it


def _recording_pin(callers: collections.Counter[str]) -> Any:
    def pin(tensor: torch.Tensor) -> torch.Tensor:
        files = {Path(frame.filename).name for frame in traceback.extract_stack()}
        callers["sampling_slots.py" if "sampling_slots.py" in files else "other"] += 1
        return tensor.clone()  # a copy, as pinning makes one

    return pin


def count_device_tensors(patch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """From now on (in `patch`'s context), the `torch.tensor(..., device=...)` calls (a
    pageable copy that waits, on a GPU), counted by the file that made them."""
    uploads: collections.Counter[str] = collections.Counter()
    original_tensor = torch.tensor

    def tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is not None:
            uploads[Path(traceback.extract_stack(limit=2)[0].filename).name] += 1
        return original_tensor(*args, **kwargs)

    patch.setattr(torch, "tensor", tensor)
    return uploads


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_steady_seeded_decode_step_uploads_nothing_for_the_sampler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    """With uploads pinned (the runner's GPU path with async scheduling), a decode step of
    seeded random rows builds no sampling tensor from Python lists: no
    `torch.tensor(..., device=...)` (a pageable copy that waits, on a GPU) anywhere in the
    step, nothing uploaded by the slots, and one read of the device."""
    model = make_tiny_llama(tmp_path, num_layers=1, vocab_size=256)
    llm = LLM(
        model=str(model), device="cpu", skip_tokenizer_init=True, max_model_len=64,
        max_num_seqs=8, enable_prefix_caching=False, async_scheduling=async_scheduling,
    )  # fmt: skip
    engine = llm.llm_engine
    runner = engine.runner
    pins: collections.Counter[str] = collections.Counter()
    runner.upload = Uploader(runner.device, pinned=True, pin=_recording_pin(pins))
    params = [
        _seeded(temperature=0.8, top_p=0.9, seed=3, max_tokens=10),
        _seeded(temperature=1.0, top_k=8, min_p=0.05, seed=4, max_tokens=10),
        _seeded(n=2, temperature=0.7, seed=5, max_tokens=10),
    ]
    for i, p in enumerate(params):
        engine.add_request(str(i), {"prompt_token_ids": [5, 9, 3 + i, 7]}, p)
    engine.step()  # the prompts (and, with async scheduling, the first decode step)
    slots = runner.step_sampler.slots
    assert slots is not None and slots.pin is not None  # the runner's pinned uploads
    num_uploads = slots.num_uploads
    assert num_uploads >= 1
    pins.clear()

    reads = 0
    original_to_host = host_reads.to_host

    def to_host(t: torch.Tensor) -> list:
        nonlocal reads
        reads += 1
        return original_to_host(t)

    def no_rebuild(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("SamplingMetadata.build in a steady decode step")

    num_steps = 0
    with monkeypatch.context() as patch:
        uploads = count_device_tensors(patch)
        patch.setattr(host_reads, "to_host", to_host)
        patch.setattr(SamplingMetadata, "build", staticmethod(no_rebuild))
        while engine.has_unfinished_requests():
            reads = 0
            engine.step()
            num_steps += 1
            # With pinned uploads the step inputs are built on the host (inputs.py, with
            # device "cpu") and go up through the pin; every other device tensor is made on
            # the device or kept there.
            assert set(uploads) <= {"inputs.py"}, uploads
            assert "sampling_slots.py" not in pins, pins
            assert reads <= 1
    assert num_steps >= 8
    assert pins["other"] >= num_steps - 1  # the steps' inputs went up pinned
    assert slots.num_uploads == num_uploads  # nothing changed, nothing copied
