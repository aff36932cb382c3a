"""Async scheduling (engine/core/async_scheduling.py): the same tokens and logprobs with and
without it, over the features it overlaps and those it falls back for; no KV leak; and
proof that it overlaps: step N+1 submitted to the real executor before step N is
collected."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from tests.model_utils import make_tiny_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("async"), vocab_size=256)


@dataclass
class Workload:
    # (step at which it joins, request id, prompt ids, params[, LoRA request])
    requests: list[tuple[Any, ...]]
    aborts: dict[int, list[str]] = field(default_factory=dict)  # step -> request ids


@dataclass
class Run:
    outputs: dict[str, list[tuple[Any, ...]]]
    calls: list[str]  # the executor's submit/collect calls, in order
    engine: Any


def _prompt(i: int, length: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": [(7 * i + 3 * k) % 240 + 3 for k in range(length)]}


_CUDA = pytest.param(
    "cuda",
    marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
)
DEVICES = pytest.mark.parametrize("device", ["cpu", _CUDA])


def run(model: Path, async_scheduling: bool, workload: Workload, **kwargs: Any) -> Run:
    args = dict(
        device="cpu", skip_tokenizer_init=True, max_model_len=128, dtype="float32",
        kv_cache_memory_bytes=1 << 22,
    )  # fmt: skip
    if kwargs.get("device") == "cuda":  # a few graphs: the placeholder ids go through them
        args["cuda_graph_sizes"] = [1, 2, 4, 8, 16]
    llm = LLM(model=str(model), async_scheduling=async_scheduling, **{**args, **kwargs})
    engine = llm.llm_engine
    assert engine.scheduler.async_scheduling == async_scheduling
    calls = _record_calls(engine.executor)
    free_at_start = engine.kv_cache_manager.get_num_free_blocks()
    outputs: dict[str, list[tuple[Any, ...]]] = {}
    pending = sorted(workload.requests, key=lambda r: r[0])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, request_id, prompt, params, *lora = pending.pop(0)
            engine.add_request(request_id, prompt, params, lora_request=(lora or [None])[0])
        engine.abort_request(workload.aborts.get(step, []))
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [_completion(c) for c in out.outputs]
        step += 1
        assert step < 500, "the run does not end"
    assert not engine.scheduler.requests
    assert not engine._in_flight  # idle: the last step's dropped rows were collected
    assert engine.kv_cache_manager.get_num_free_blocks() == free_at_start  # no KV leak
    return Run(outputs, calls, engine)


def _completion(c: Any) -> tuple[Any, ...]:
    logprobs = None
    if c.logprobs is not None:
        logprobs = [sorted((t, lp.logprob) for t, lp in pos.items()) for pos in c.logprobs]
    return (c.index, list(c.token_ids), logprobs, c.finish_reason, c.stop_reason)


def _record_calls(executor: Any) -> list[str]:
    """Wraps the real executor's submit/collect (they still run) to log their order."""
    calls: list[str] = []

    def wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any) -> Any:
            calls.append(name)
            return method(*args)

        return recorded

    executor.submit = wrap("submit", executor.submit)
    executor.collect = wrap("collect", executor.collect)
    return calls


def assert_same(sync: Run, overlapped: Run) -> None:
    assert sync.outputs.keys() == overlapped.outputs.keys()
    for request_id, expected in sync.outputs.items():
        got = overlapped.outputs[request_id]
        for (i, ids, lps, reason, stop), (j, ids2, lps2, reason2, stop2) in zip(expected, got):
            assert (i, ids, reason, stop) == (j, ids2, reason2, stop2), request_id
            if lps is None:
                assert lps2 is None
                continue
            assert [[t for t, _ in pos] for pos in lps] == [[t for t, _ in pos] for pos in lps2]
            flat = [v for pos in lps for _, v in pos]
            assert [v for pos in lps2 for _, v in pos] == pytest.approx(flat, abs=1e-4)


def num_overlapped(calls: list[str]) -> int:
    """Steps submitted while another was in flight (submitted, not yet collected)."""
    in_flight = overlapped = 0
    for call in calls:
        if call == "submit":
            overlapped += in_flight > 0
            in_flight += 1
        else:
            in_flight -= 1
    return overlapped


def both(model: Path, workload: Workload, **kwargs: Any) -> tuple[Run, Run]:
    sync = run(model, False, workload, **kwargs)
    overlapped = run(model, True, workload, **kwargs)
    assert num_overlapped(sync.calls) == 0
    assert_same(sync, overlapped)
    return sync, overlapped


_GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
_SEEDED = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=3, max_tokens=10, logprobs=2)


def test_step_n_plus_1_is_submitted_before_step_n_is_collected(model: Path) -> None:
    workload = Workload([(0, "a", _prompt(0, 9), _GREEDY), (0, "b", _prompt(1, 5), _SEEDED)])
    sync, overlapped = both(model, workload)
    # The first call submits the prompts' step and the first decode step, then collects.
    assert overlapped.calls[:3] == ["submit", "submit", "collect"]
    assert sync.calls[:3] == ["submit", "collect", "submit"]
    assert num_overlapped(overlapped.calls) >= 9  # every decode step but the last


@DEVICES
def test_greedy_seeded_n_stop_tokens_max_tokens_abort_and_joins(model: Path, device: str) -> None:
    """Requests join mid-run with long prompts in chunks of 16 tokens, one is aborted
    mid-stream, one stops at a token it samples (EOS-like), others at max_tokens; n = 3."""
    probe = run(model, False, Workload([(0, "p", _prompt(2, 6), _GREEDY)]), device=device)
    stop_token = probe.outputs["p"][0][1][4]  # a token the greedy run samples 5th
    requests = [
        (0, "greedy", _prompt(0, 7), _GREEDY),
        (0, "seeded", _prompt(1, 11), _SEEDED),
        (0, "stops", _prompt(2, 6), SamplingParams(temperature=0.0, max_tokens=12,
                                                    stop_token_ids=[stop_token])),
        (1, "n3", _prompt(3, 5), SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6)),
        (2, "aborted", _prompt(4, 8), SamplingParams(temperature=0.0, max_tokens=30)),
        (3, "long", _prompt(5, 50), SamplingParams(temperature=0.7, seed=2, max_tokens=5)),
        (5, "late", _prompt(6, 33), SamplingParams(temperature=0.0, max_tokens=1)),
        (6, "later", _prompt(7, 20), SamplingParams(temperature=0.0, max_tokens=4, logprobs=1)),
    ]  # fmt: skip
    workload = Workload(requests, aborts={6: ["aborted"]})
    sync, overlapped = both(model, workload, max_num_batched_tokens=16, device=device)
    assert sync.outputs["stops"][0][3] == "stop" and len(sync.outputs["stops"][0][1]) == 5
    assert sync.outputs["aborted"][0][3] == "abort"
    assert len(sync.outputs["n3"]) == 3
    assert num_overlapped(overlapped.calls) > 5


@DEVICES
def test_preemption_with_a_step_in_flight(model: Path, device: str) -> None:
    requests = [
        (i // 3, f"r{i}", _prompt(i, 10 + 3 * i),
         SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=24, ignore_eos=True))
        for i in range(6)
    ]  # fmt: skip
    sync, overlapped = both(
        model, Workload(requests), num_gpu_blocks_override=14, block_size=8, device=device
    )
    assert sync.engine.scheduler.num_preemptions_total > 0
    assert overlapped.engine.scheduler.num_preemptions_total > 0
    assert num_overlapped(overlapped.calls) > 0


def test_fallback_features_give_the_same_tokens(model: Path) -> None:
    """min_tokens, bad words and prompt logprobs read the host: those steps run
    synchronously (the others, penalties among them, overlap)."""
    requests = [
        (0, "plain", _prompt(0, 6), _GREEDY),
        (0, "penalised", _prompt(1, 6),
         SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=8, ignore_eos=True)),
        (0, "min-tokens", _prompt(2, 6),
         SamplingParams(temperature=0.0, min_tokens=4, max_tokens=8, ignore_eos=True)),
        (9, "prompt-lp", _prompt(3, 6),
         SamplingParams(temperature=0.0, prompt_logprobs=1, max_tokens=3, ignore_eos=True)),
    ]  # fmt: skip
    both(model, Workload(requests))


def test_ngram_speculation_falls_back(model: Path) -> None:
    repeating = {"prompt_token_ids": [5, 6, 7, 8] * 6}
    requests = [(0, "spec", repeating, _GREEDY), (0, "other", _prompt(1, 9), _GREEDY)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    _, overlapped = both(model, Workload(requests), speculative_config=spec)
    assert overlapped.engine.scheduler.num_draft_tokens > 0
    assert num_overlapped(overlapped.calls) == 0  # every step needs the host's tokens


def test_lora_requests(tmp_path: Path) -> None:
    from tests.lora_utils import make_peft_adapter

    base = make_tiny_llama(tmp_path / "base", vocab_size=256)
    make_peft_adapter(
        base, tmp_path / "lora", rank=4, alpha=8, targets=["q_proj", "v_proj"], seed=1
    )
    lora = LoRARequest("a", 1, str(tmp_path / "lora"))
    requests = [
        (0, "base", _prompt(0, 7), _GREEDY),
        (0, "lora", _prompt(0, 7), _GREEDY, lora),
        (2, "lora-seeded", _prompt(1, 9), _SEEDED, lora),
    ]
    sync, overlapped = both(base, Workload(requests), enable_lora=True, max_lora_rank=8)
    assert sync.outputs["base"][0][1] != sync.outputs["lora"][0][1]  # the adapter acts
    assert num_overlapped(overlapped.calls) > 0


def test_the_flag_is_checked() -> None:
    from engine import EngineArgs

    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs(model=None, async_scheduling="yes").create_engine_config()  # type: ignore[arg-type]


def test_structured_outputs_fall_back_and_stop_strings(tmp_path: Path) -> None:
    """A constrained request's next bitmask follows the token it samples: the steps it
    samples in run synchronously; the plain request beside it is unchanged too. A stop
    string (found by the engine's detokenizer, after the scheduler's update) drops the
    token of the step in flight."""
    from engine.structured_output import StructuredOutputsParams

    model = make_tiny_llama(tmp_path / "tok", with_tokenizer=True, num_layers=1)
    probe = run(model, False, Workload([(0, "p", _prompt(4, 6), _GREEDY)]),
                skip_tokenizer_init=False)  # fmt: skip
    probe_ids = probe.outputs["p"][0][1]
    stop = probe.engine.tokenizer.decode(probe_ids[3:6]).strip()
    assert stop
    regex = StructuredOutputsParams(regex=r"[a-c ]{4,12}")
    requests = [
        (0, "stop-string", _prompt(4, 6), SamplingParams(temperature=0.0, max_tokens=12,
                                                         ignore_eos=True, stop=[stop])),
        (0, "plain", _prompt(0, 6), _GREEDY),
        (2, "regex", _prompt(1, 6), SamplingParams(temperature=0.0, max_tokens=16,
                                                   structured_outputs=regex)),
        (3, "regex-seeded", _prompt(2, 6), SamplingParams(temperature=0.8, seed=4, max_tokens=16,
                                                          structured_outputs=regex)),
    ]  # fmt: skip
    sync, overlapped = both(model, Workload(requests), skip_tokenizer_init=False)
    assert sync.outputs["regex"][0][3] == "stop"  # the grammar ended it
    assert sync.outputs["stop-string"][0][3:] == ("stop", stop)
    assert len(sync.outputs["stop-string"][0][1]) < 12
    assert num_overlapped(overlapped.calls) > 0  # before the constrained requests joined
