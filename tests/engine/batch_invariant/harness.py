"""The batch-invariance harness: one probe request's tokens and logprobs, bit for bit, alone
and in batches of neighbours of mixed lengths (EngineArgs `batch_invariant`).

A `Probe` is a prompt with greedy and seeded sampling parameters; `run_probe` runs it on an
engine together with neighbours and returns what it produced as exact Python values (token
ids and the float32 logprobs of the sampled and top tokens, compared with ==, no tolerance).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from engine import LLM, SamplingParams

MAX_TOKENS = 12
NUM_LOGPROBS = 3


@dataclass(frozen=True)
class Probe:
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


def probes(vocab_size: int, prompt_len: int = 40, seed: int = 0) -> dict[str, Probe]:
    """A greedy and a seeded probe over the same prompt (ids from 3: no bos/eos)."""
    rng = random.Random(seed)
    prompt = tuple(rng.randrange(3, vocab_size) for _ in range(prompt_len))
    common: dict[str, Any] = dict(max_tokens=MAX_TOKENS, logprobs=NUM_LOGPROBS, ignore_eos=True)
    return {
        "greedy": Probe(prompt, SamplingParams(temperature=0.0, **common)),
        "seeded": Probe(prompt, SamplingParams(temperature=0.8, top_p=0.95, seed=1234, **common)),
    }


def neighbours(
    count: int, vocab_size: int, seed: int, max_prompt: int = 90
) -> list[tuple[list[int], SamplingParams]]:
    """`count` requests of mixed prompt and output lengths, greedy and seeded mixed."""
    rng = random.Random(seed)
    batch = []
    for i in range(count):
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, max_prompt))]
        temperature = 0.0 if i % 2 else 1.0
        params = SamplingParams(
            temperature=temperature,
            seed=rng.randrange(1 << 30),
            max_tokens=rng.randint(1, MAX_TOKENS + 4),
            ignore_eos=True,
        )
        batch.append((prompt, params))
    return batch


def result(output: Any) -> tuple[tuple[int, ...], tuple[tuple[tuple[int, float], ...], ...]]:
    """The completion's token ids and, per position, its (token id, logprob) pairs."""
    completion = output.outputs[0]
    logprobs = tuple(
        tuple(sorted((tid, lp.logprob) for tid, lp in position.items()))
        for position in completion.logprobs
    )
    return tuple(completion.token_ids), logprobs


def run_probe(
    llm: LLM,
    probe: Probe,
    batch: list[tuple[list[int], SamplingParams]] = (),  # type: ignore[assignment]
    position: int = 0,
    cached: list[int] | None = None,
) -> tuple[Any, ...]:
    """The probe's result when it arrives at `position` among `batch`'s requests (all
    added at once, so they share the steps); `cached` gets the probe's prompt tokens found
    in the prefix cache."""
    requests = list(batch)
    requests.insert(position, (list(probe.prompt_token_ids), probe.params))
    outputs = llm.generate(
        [{"prompt_token_ids": prompt} for prompt, _ in requests],
        [params for _, params in requests],
        use_tqdm=False,
    )
    if cached is not None:
        cached.append(outputs[position].num_cached_tokens or 0)
    return result(outputs[position])


def first_difference(expected: tuple[Any, ...], actual: tuple[Any, ...]) -> str:
    """Where two results part (for the assertion message)."""
    tokens_a, logprobs_a = expected
    tokens_b, logprobs_b = actual
    for i, (a, b) in enumerate(zip(tokens_a, tokens_b)):
        if a != b:
            return f"token {i}: {b} instead of {a}"
    for i, (a, b) in enumerate(zip(logprobs_a, logprobs_b)):
        if a != b:
            return f"logprobs at token {i}: {b} instead of {a}"
    return "lengths differ" if expected != actual else "equal"
