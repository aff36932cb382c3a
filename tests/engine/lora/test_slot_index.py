"""The LoRA hooks' per-token slot index (engine/lora/slot_index.py): the values of each
layout, no upload when a step's layout equals the last one, the GPU's pinned path (forced on
the CPU with a stand-in allocator and event: two host buffers in turn, each rewritten only
after its last copy's event). In the engine: the same tokens as today's index, rebuilt from
a Python list every step, across joins, leaves, preemption (reordered batches) and chunked
prefills beside decodes; and a steady LoRA decode step on the pinned path makes no blocking
upload and copies no index."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.lora import manager as lora_manager
from engine.lora.slot_index import SlotIndex
from engine.worker.uploads import Uploader
from tests.engine.front.test_async_scheduling import Workload, _prompt, assert_same, run
from tests.engine.worker.test_persistent_sampling import count_device_tensors
from tests.model_utils import make_tiny_llama

CPU = torch.device("cpu")


def _expanded(runs: list[tuple[int, int]]) -> list[int]:
    return [slot for slot, n in runs for _ in range(n)]


class _Event:
    """A CUDA event's stand-in: remembers whether the host waited for it."""

    log: ClassVar[list[_Event]] = []

    def __init__(self) -> None:
        self.recorded = self.synchronized = False
        _Event.log.append(self)

    def record(self) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        self.synchronized = True


def _host_alloc(numel: int) -> torch.Tensor:  # pinned memory's stand-in on the CPU
    return torch.full((numel,), -7, dtype=torch.int64)


def _pinned_index(device: torch.device, capacity: int = 256) -> SlotIndex:
    return SlotIndex(device, pinned=True, alloc=_host_alloc, make_event=_Event,
                     capacity=capacity)  # fmt: skip


LAYOUTS = [
    [(0, 5), (-1, 3), (1, 2)],  # prefills
    [(0, 1), (-1, 1), (1, 1)],  # their first decode step
    [(0, 1), (-1, 1), (1, 1)],  # steady
    [(0, 1), (-1, 1), (1, 1)],
    [(-1, 1), (0, 1), (1, 1)],  # reordered
    [(-1, 1), (1, 1)],  # one left
    [(-1, 1), (1, 1), (0, 7)],  # one joined: a prefill beside decodes
    [(2, 300)],  # past the capacity
    [(-1, 1), (1, 1)],
]


@pytest.mark.parametrize("pinned", [False, True], ids=["plain", "pinned"])
def test_values_and_uploads_only_when_the_layout_changes(pinned: bool) -> None:
    index = _pinned_index(CPU, capacity=16) if pinned else SlotIndex(CPU)
    assert index.pinned == pinned
    last, uploads = None, 0
    for runs in LAYOUTS:
        values = index.update(runs)
        assert values.dtype == torch.int64 and values.device == CPU
        assert values.tolist() == _expanded(runs)
        uploads += runs != last
        assert index.num_uploads == uploads
        last = runs
    assert uploads == len(LAYOUTS) - 2  # the two steady steps uploaded nothing


def test_the_cpu_default_is_plain_and_cuda_pinned() -> None:
    assert not SlotIndex(CPU).pinned
    assert SlotIndex(torch.device("cuda"), make_event=_Event).pinned  # nothing allocated yet


def test_pinned_buffers_alternate_and_wait_for_their_last_copy() -> None:
    _Event.log = []
    index = _pinned_index(CPU)
    changing = [[(0, 2 + k), (-1, 1)] for k in range(6)]
    for k, runs in enumerate(changing):
        index.update(runs)
        host = index._host[k % 2]  # this step's pinned buffer
        assert host[: len(_expanded(runs))].tolist() == _expanded(runs)
        events = _Event.log
        assert len(events) == k + 1 and all(e.recorded for e in events)
        # The buffer's copy of two steps ago was waited for before it was rewritten; the
        # other buffer's (the step before's copy, maybe still in flight) was not.
        assert [e.synchronized for e in events] == [i <= k - 2 for i in range(k + 1)]
    index.update(changing[-1])  # unchanged: no copy, no event, no wait
    assert len(_Event.log) == len(changing) and not _Event.log[-1].synchronized


# ---- in the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LoRARequest, LoRARequest]:
    from tests.lora_utils import make_peft_adapter

    root = tmp_path_factory.mktemp("slot-index")
    base = make_tiny_llama(root / "base", vocab_size=256)
    make_peft_adapter(base, root / "a", rank=4, alpha=8, targets=["q_proj", "v_proj"], seed=1)
    make_peft_adapter(base, root / "b", rank=2, alpha=4, targets=["o_proj", "down_proj"], seed=2)
    return base, LoRARequest("a", 1, str(root / "a")), LoRARequest("b", 2, str(root / "b"))


def _todays_index(self: SlotIndex, runs: Any) -> torch.Tensor:
    """The index as before: a tensor made from the per-token list every step."""
    self.num_uploads += 1
    return torch.tensor(_expanded(list(runs)), device=self.device)


def _forced_pinned(device: torch.device) -> SlotIndex:
    return _pinned_index(device, capacity=4)  # small: the buffers grow on the way


def _seeded(**kwargs: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.9, "top_p": 0.9, "ignore_eos": True, **kwargs})


def test_same_tokens_as_todays_index(
    monkeypatch: pytest.MonkeyPatch, adapters: tuple[Path, LoRARequest, LoRARequest]
) -> None:
    """Joins, leaves (different lengths, an abort), preemption with its recompute (the batch
    reordered) and chunked prefills beside decodes: the tokens of today's index, with the
    persistent index plain and pinned (async scheduling off and on)."""
    base, a, b = adapters
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    requests = [
        (0, "a-greedy", _prompt(0, 9), greedy, a),
        (0, "base", _prompt(1, 6), _seeded(seed=1, max_tokens=12)),
        (0, "b-seeded", _prompt(2, 11), _seeded(seed=2, max_tokens=7, logprobs=2), b),
        (2, "a-late", _prompt(3, 20), _seeded(seed=3, max_tokens=9), a),
        (3, "b-aborted", _prompt(4, 5), _seeded(seed=4, max_tokens=30), b),
        (5, "b-late", _prompt(5, 13), greedy, b),
    ]
    workload = Workload(requests, aborts={9: ["b-aborted"]})
    kwargs = dict(
        enable_lora=True, max_lora_rank=8, max_loras=2, num_gpu_blocks_override=12,
        block_size=8, max_num_batched_tokens=16,
    )  # fmt: skip
    with monkeypatch.context() as patch:
        patch.setattr(SlotIndex, "update", _todays_index)
        today = run(base, False, workload, **kwargs)
    updates: collections.Counter[int] = collections.Counter()
    original_update = SlotIndex.update

    def counted(self: SlotIndex, runs: Any) -> torch.Tensor:
        updates[id(self)] += 1
        return original_update(self, runs)

    monkeypatch.setattr(SlotIndex, "update", counted)
    plain = run(base, False, workload, **kwargs)
    monkeypatch.setattr(lora_manager, "SlotIndex", _forced_pinned)
    pinned = run(base, False, workload, **kwargs)
    pinned_async = run(base, True, workload, **kwargs)

    assert today.engine.scheduler.num_preemptions_total > 0
    assert today.outputs["b-aborted"][0][3] == "abort"
    assert plain.outputs == today.outputs  # token ids, logprobs, finish reasons: exact
    assert pinned.outputs == today.outputs
    # Under async scheduling the abort lands after another number of steps: the aborted
    # request's tokens are a prefix of today's, the others' equal.
    aborted_ids = pinned_async.outputs["b-aborted"][0][1]
    assert aborted_ids == today.outputs["b-aborted"][0][1][: len(aborted_ids)]
    for result in (today, pinned_async):
        del result.outputs["b-aborted"]
    assert_same(today, pinned_async)
    for result in (plain, pinned, pinned_async):
        index = result.engine.runner.lora_manager.slot_index
        assert index.pinned == (result is not plain)
        assert 0 < index.num_uploads < updates[id(index)]  # steady steps uploaded nothing
    assert today.outputs["a-greedy"][0][1] != today.outputs["base"][0][1]


def _recording_pin(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone()  # a copy, as pinning makes one


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_steady_lora_decode_step_uploads_nothing_and_never_blocks(
    monkeypatch: pytest.MonkeyPatch,
    adapters: tuple[Path, LoRARequest, LoRARequest],
    async_scheduling: bool,
) -> None:
    """The GPU's path forced on the CPU (the runner's pinned uploads, the pinned index): a
    decode step of base and adapter rows makes no `torch.tensor(..., device=...)` (a pageable
    copy that waits, on a GPU) outside the step inputs, and copies no index."""
    base, a, b = adapters
    monkeypatch.setattr(lora_manager, "SlotIndex", _forced_pinned)
    llm = LLM(
        model=str(base), device="cpu", skip_tokenizer_init=True, max_model_len=64,
        max_num_seqs=8, enable_prefix_caching=False, async_scheduling=async_scheduling,
        enable_lora=True, max_lora_rank=8, max_loras=2, dtype="float32",
    )  # fmt: skip
    engine = llm.llm_engine
    runner = engine.runner
    runner.upload = Uploader(runner.device, pinned=True, pin=_recording_pin)
    for i, lora in enumerate([a, None, b, a]):
        params = _seeded(seed=i, max_tokens=10)
        engine.add_request(str(i), {"prompt_token_ids": [5, 9, 3 + i, 7]}, params,
                           lora_request=lora)  # fmt: skip
    engine.step()  # the prompts (and, with async scheduling, the first decode step)
    engine.step()
    index = runner.lora_manager.slot_index
    assert index.pinned and index.num_uploads == 2  # the prompts', the decodes'

    num_steps = 0
    with monkeypatch.context() as patch:
        uploads = count_device_tensors(patch)
        while engine.has_unfinished_requests():
            engine.step()
            num_steps += 1
            assert set(uploads) <= {"inputs.py"}, uploads
    assert num_steps >= 6
    assert index.num_uploads == 2  # the layout never changed: nothing copied
