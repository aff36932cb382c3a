"""The two dataclasses that cross the scheduler/runner boundary, one each way.

Both sides live in one process, so a scheduled entry carries a reference to its `Request`
(the runner reads token ids and sampling parameters from it) rather than a serialised copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: `num_new_tokens` tokens starting at
    `num_computed_tokens`, their keys/values going into the blocks of `block_ids`.

    A speculative entry computes its last known token followed by draft tokens::

        all_token_ids  ... t9 | spec_token_ids  d0 d1 d2     num_new_tokens = 1 + 3
        token_ids          t9 d0 d1 d2
    """

    request: Request
    num_computed_tokens: int  # before this step (prefix-cache hits included)
    num_new_tokens: int  # including the drafts
    block_ids: list[int]  # the request's whole block table after this step's allocation
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify
    # The request's preemption count when scheduled: with several steps in flight
    # (pipeline parallelism) an output computed before a preemption is dropped.
    num_preemptions: int = 0
    # Async scheduling (engine/core/async_scheduling.py): the entry's last
    # `num_placeholder_inputs` tokens are ones a step still in flight samples; the runner
    # takes their ids from that step's sampled ids on the device. `adds_placeholder`: this
    # entry's own sampled token was counted in `request.num_output_placeholders`.
    num_placeholder_inputs: int = 0
    adds_placeholder: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        """The step's input ids; 0 stands for each placeholder (filled on the device)."""
        start = self.num_computed_tokens
        if not self.spec_token_ids and not self.num_placeholder_inputs:
            # read for every row of every step: the short way
            return self.request.all_token_ids[start : start + self.num_new_tokens]
        num_known = self.num_new_tokens - len(self.spec_token_ids) - self.num_placeholder_inputs
        known = self.request.all_token_ids[start : start + num_known]
        if self.num_placeholder_inputs:
            known = known + [0] * self.num_placeholder_inputs
        return known + self.spec_token_ids

    @property
    def reaches_last_token(self) -> bool:
        """True when this step computes the request's last known token (or, for an entry
        with placeholder inputs, the token a step in flight samples)."""
        if self.num_placeholder_inputs:
            return True
        num_known = self.num_new_tokens - len(self.spec_token_ids)
        return self.num_computed_tokens + num_known == len(self.request.all_token_ids)

    @property
    def samples(self) -> bool:
        """True when this step samples the request's next token (`reaches_last_token`,
        inlined: read for every row of every step)."""
        request = self.request
        if request.is_pooling:
            return False
        if self.num_placeholder_inputs:  # async scheduling: after the token in flight
            return True
        num_known = self.num_new_tokens - len(self.spec_token_ids)
        return self.num_computed_tokens + num_known == len(request.all_token_ids)

    @property
    def pools(self) -> bool:
        """True when this step completes a pooling request's prompt, so it is pooled."""
        return self.reaches_last_token and self.request.is_pooling


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # in scheduling order (priority order, then arrival)
    num_scheduled_tokens: int
    # Requests that finished or were aborted/preempted since the previous step: the runner
    # drops any per-request state it keeps for them.
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class LogprobsLists:
    """Logprobs of consecutive positions: row i = [chosen token, top-k...]."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # rank of the chosen token at each position (1 = most likely)


@dataclass
class ModelRunnerOutput:
    # One entry per request that sampled this step (speculative entries excepted).
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Per speculative entry: its accepted drafts followed by one more token (1..k+1).
    spec_output_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Prompt logprobs computed this step: (position of the first token covered, lists).
    prompt_logprobs: dict[str, tuple[int, LogprobsLists]] = field(default_factory=dict)
    # Pooled vectors of the pooling requests whose prompt completed this step (each a
    # float32 CPU torch.Tensor [hidden_size]; typed Any to keep this module torch-free).
    pooled: dict[str, Any] = field(default_factory=dict)
