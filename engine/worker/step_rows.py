"""Which rows of a step do what: split out of the model runner's step (one pass)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.sched_output import ScheduledRequest, SchedulerOutput


@dataclass
class StepRows:
    """A step's entries, decode rows (one query token) first, then prefill chunks: the
    layout the attention backends expect; and the indices of the rows that sample, verify
    drafts, pool (every chunk: MEAN and CLS accumulate over chunks) or want prompt
    logprobs."""

    batch: list[ScheduledRequest]
    requests: list[tuple[list[int], int, list[int]]]  # build_step_inputs' rows
    sampling: list[int] = field(default_factory=list)
    speculative: list[int] = field(default_factory=list)
    pooling: list[int] = field(default_factory=list)
    prompt_lp: list[int] = field(default_factory=list)

    @property
    def has_placeholders(self) -> bool:
        return any(e.num_placeholder_inputs for e in self.batch)


def classify_rows(
    scheduler_output: SchedulerOutput,
    wants_prompt_logprobs: Callable[[ScheduledRequest], bool],
) -> StepRows:
    batch = sorted(scheduler_output.scheduled, key=lambda e: e.num_new_tokens != 1)
    rows = StepRows(batch, [])
    for i, e in enumerate(batch):
        rows.requests.append((e.token_ids, e.num_computed_tokens, e.block_ids))
        if e.spec_token_ids:
            rows.speculative.append(i)
        elif e.samples:
            rows.sampling.append(i)
        if e.request.is_pooling:
            rows.pooling.append(i)
        elif wants_prompt_logprobs(e):
            rows.prompt_lp.append(i)
    return rows
