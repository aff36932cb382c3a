"""Beam search (vLLM's `BeamSearchParams` / `BeamSearchOutput`), scored as Hugging Face
transformers' `generate(num_beams=k, do_sample=False, length_penalty, early_stopping)`.

The search is driven from outside the engine step, as vLLM's `LLM.beam_search` does: each
step runs every live beam as a one-token request asking for its top logprobs; the beams'
shared prompt and history sit in full KV blocks that the prefix cache hands to every
request (only the last, partial block is written anew: copy-on-write). This file is the
bookkeeping only, plain Python, so the library and the gRPC service share it:

    step t   running beams (≤ k) ── top logprobs each ──▶ candidates, best cumulative first
             top (1 + #eos)·k candidates:
               ├─ among the first k, those ending in EOS (or at max_tokens) → finished,
               │  score = cum_logprob / generated_len ** length_penalty (EOS counted)
               └─ the best k that do not stop → running
             stop: early_stopping=True and k finished; or no running beam can beat the worst
             finished one (transformers' heuristic; "never": bound at max_tokens); or
             max_tokens reached.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from engine.api.outputs import Logprob
from engine.api.sampling_params import BeamSearchParams

_DEAD = -1.0e9  # transformers' "impossible" score


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's followed by the generated ones (as vLLM)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    score: float = 0.0  # cum_logprob / generated_len ** length_penalty (finished beams)


@dataclass
class BeamSearchOutput:
    """The final beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearchInstance:
    """The search of one prompt. Call `running` for the beams to expand, then `advance`
    with each one's top logprobs, until `done`."""

    def __init__(
        self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: set[int]
    ) -> None:
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.running = [BeamSearchSequence(tokens=list(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.num_generated = 0
        self.done = False
        self._improvable = True  # transformers' is_early_stop_heuristic_unsatisfied

    @property
    def num_candidates(self) -> int:
        """How many top logprobs each beam must report: enough that the best
        (1 + #eos)·k continuations over all beams are among them."""
        return max(2, 1 + len(self.eos_token_ids)) * self.params.beam_width

    def advance(self, top_logprobs: list[dict[int, float]]) -> None:
        """One step: `top_logprobs[i]` maps token id -> logprob for `running[i]`."""
        k = self.params.beam_width
        candidates = [
            (beam.cum_logprob + lp, i, token_id)
            for i, (beam, top) in enumerate(zip(self.running, top_logprobs))
            for token_id, lp in top.items()
        ]
        # Best first; ties by beam then token id, as a flat top-k over (beam, vocab) does.
        top = heapq.nsmallest(self.num_candidates, candidates, key=lambda c: (-c[0], c[1], c[2]))
        at_length = self.num_generated + 1 >= self.params.max_tokens
        stops = [at_length or token_id in self.eos_token_ids for _, _, token_id in top]
        extend = self._extend
        full = len(self.finished) == k and self.params.early_stopping is True
        if self._improvable and not full:
            length = (self.num_generated + 1) ** self.params.length_penalty
            for rank, ((cum, i, token_id), stop) in enumerate(zip(top, stops)):
                if stop and rank < k:
                    beam = extend(self.running[i], token_id, cum, top_logprobs[i])
                    beam.score = cum / length
                    beam.finish_reason = "stop" if token_id in self.eos_token_ids else "length"
                    self.finished.append(beam)
            self.finished.sort(key=lambda b: -b.score)
            del self.finished[k:]
        live = [(cum, i, t) for (cum, i, t), stop in zip(top, stops) if not stop][:k]
        self.running = [extend(self.running[i], t, cum, top_logprobs[i]) for cum, i, t in live]
        self.num_generated += 1
        self._check_done(all(stops))

    def _extend(
        self, beam: BeamSearchSequence, token_id: int, cum: float, top: dict[int, float]
    ) -> BeamSearchSequence:
        rank = 1 + sum(1 for lp in top.values() if lp > top[token_id])
        return BeamSearchSequence(
            tokens=[*beam.tokens, token_id],
            logprobs=[*beam.logprobs, {token_id: Logprob(top[token_id], rank)}],
            cum_logprob=cum,
        )

    def _check_done(self, all_stopped: bool) -> None:
        params, k = self.params, self.params.beam_width
        if len(self.finished) == k and self.running:
            if params.early_stopping == "never" and params.length_penalty > 0.0:
                best_length = params.max_tokens
            else:
                best_length = self.num_generated
            best_possible = self.running[0].cum_logprob / best_length**params.length_penalty
            self._improvable = self._improvable and best_possible > self.finished[-1].score
        full = len(self.finished) == k and params.early_stopping is True
        self.done = all_stopped or not self._improvable or full or not self.running

    def output(self, aborted: bool = False) -> BeamSearchOutput:
        """The best k finished beams; if the search ended before k finished (no live beam
        left), the best running ones fill in, as in vLLM. `aborted`: the search was stopped
        early; the running beams that fill in end with finish_reason "abort"."""
        beams = list(self.finished)
        if len(beams) < self.params.beam_width:
            for beam in self.running:
                generated = max(1, len(beam.tokens) - self.num_prompt_tokens)
                beam.score = beam.cum_logprob / generated**self.params.length_penalty
                beam.finish_reason = "abort" if aborted else "length"
            beams += self.running
            beams.sort(key=lambda b: -b.score)
        return BeamSearchOutput(sequences=beams[: self.params.beam_width])
