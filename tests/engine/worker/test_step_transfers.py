"""Device-to-host transfers per decode step: at most one (issue 42).

On a GPU each read of a device tensor (`.item()`, `.tolist()`, `.cpu()`, `.numpy()`,
`.to("cpu")`, `torch.cuda.synchronize()`) waits for the step to finish. Here the tensors
are on the host, so the test counts the calls themselves, on any tensor, during whole
`LLMEngine.step()`s of pure decode: a read that would be a transfer on a GPU is a call
here too. It also counts the runner's one reading helper (`host_reads.to_host`).
`.to(device)` is not counted: with the runner's device the CPU, an upload of step inputs
(`.to(runner.device)`) cannot be told from a download here.

Features that still read more than once per step (their own reads, not the plain decode
path): prompt logprobs (one per request that asks), n-gram draft verification (one more),
pooling (one per pooled request).
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker import host_reads
from engine.worker.host_reads import StepReads
from tests.model_utils import make_tiny_llama

_READS = ("item", "tolist", "cpu", "numpy")


@contextmanager
def _count_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    """Counts host reads of tensors (by the caller's file:line) while the block runs."""
    counts: collections.Counter[str] = collections.Counter()

    def where(name: str) -> str:
        caller = traceback.extract_stack(limit=3)[0]
        return f"{name} at {Path(caller.filename).name}:{caller.lineno}"

    def counting(name: str, original):
        def method(self, *args, **kwargs):
            counts[where(name)] += 1
            return original(self, *args, **kwargs)

        return method

    for name in _READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda *a, **k: counts.update([where("synchronize")])
    )
    original_to_host = host_reads.to_host

    def to_host(tensor: torch.Tensor) -> list:
        counts["to_host"] += 1
        return original_to_host(tensor)

    monkeypatch.setattr(host_reads, "to_host", to_host)
    yield counts
    monkeypatch.undo()


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def llm(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> LLM:
    """With async scheduling a step() launches step N+1 (its copy started: the read, on
    the CPU) and finishes step N (its copy already done): still one read per step."""
    model = make_tiny_llama(tmp_path_factory.mktemp("m"), num_layers=1, vocab_size=256)
    return LLM(
        model=str(model), device="cpu", skip_tokenizer_init=True, max_model_len=64,
        max_num_seqs=8, enable_prefix_caching=False, async_scheduling=request.param,
    )  # fmt: skip


_GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
_SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True)
_LOGPROBS = SamplingParams(temperature=0.0, logprobs=2, max_tokens=8, ignore_eos=True)
_PENALISED = SamplingParams(
    temperature=0.7, seed=5, repetition_penalty=1.2, max_tokens=8, ignore_eos=True
)


@pytest.mark.parametrize(
    "mix",
    [[_GREEDY] * 3, [_SEEDED] * 2, [_GREEDY, _SEEDED, _LOGPROBS, _PENALISED]],
    ids=["greedy", "seeded", "mixed-with-logprobs"],
)
def test_a_decode_step_reads_the_device_at_most_once(
    llm: LLM, mix: list[SamplingParams], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = llm.llm_engine
    for i, params in enumerate(mix):
        engine.add_request(f"{id(mix)}-{i}", {"prompt_token_ids": [5, 9, 3 + i, 7]}, params)
    engine.step()  # the prompts
    assert all(r.output_token_ids for r in engine.scheduler.running)
    num_steps = 0
    while engine.has_unfinished_requests():
        with _count_reads(monkeypatch) as counts:
            engine.step()
        num_steps += 1
        reads = {k: v for k, v in counts.items() if k != "to_host"}
        assert sum(reads.values()) <= 1, reads
        assert counts["to_host"] == sum(reads.values()), counts  # all through the helper
    assert num_steps == 7  # max_tokens 8: one from the prompt step, seven decode steps


def test_step_reads_equal_separate_reads() -> None:
    """Packed into one copy, each part reads back as its own `.tolist()` would."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2**40, (5,), generator=generator)  # int64 beyond int32
    values = torch.randn(5, 3, generator=generator)  # float32, not exact in float16
    ranks = torch.randint(1, 100, (5,), generator=generator)
    top = torch.randint(0, 1000, (5, 3), generator=generator)
    reads = StepReads()
    slots = [reads.add(t) for t in (ids, top, values, ranks)]
    host = reads.read()
    for slot, tensor in zip(slots, (ids, top, values, ranks)):
        assert host[slot] == tensor.tolist()
        assert type(host[slot][0]) is type(tensor.tolist()[0])
    only_ints = StepReads()
    assert only_ints.read() == []
    only_ints.add(ids)
    assert only_ints.read() == [ids.tolist()]
