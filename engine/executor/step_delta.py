"""The step description the driver sends its ranks: what changed since the last step.

In one process the runner reads each scheduled `Request` directly. Across processes the
driver sends, per step, one `StepDelta`: a request's prompt and parameters once (the first
time it is scheduled, or again after a preemption), then only its counters, the output
tokens appended since, and the blocks added to its table. Each rank keeps a mirror of the
live requests (`RequestMirror`) and rebuilds the `SchedulerOutput` its runner takes, so the
runner is the same code with one process or many::

    driver                                   rank r
    scheduler.schedule() -> SchedulerOutput
    StepDeltaBuilder.build()  --StepDelta-->  RequestMirror.apply() -> SchedulerOutput
                                              ModelRunner.execute()
    ModelRunnerOutput  <------(driver rank only)------------------------'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.request import Request
from engine.core.sched_output import ScheduledRequest, SchedulerOutput


@dataclass(slots=True)
class NewRequestData:
    """What a rank needs of a request it has not seen (or saw before a preemption)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: Any  # SamplingParams | None
    pooling_params: Any  # PoolingParams | None
    seed: int
    rope_length: int  # Request.rope_length (engine/config/rope.py)
    lora_request: Any = None  # LoRARequest | None: each rank applies its shard of it


@dataclass(slots=True)
class ScheduledDelta:
    """One scheduled request's share of the step, as a change to the rank's mirror."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    new_output_token_ids: list[int]  # appended since the rank last saw the request
    block_ids: list[int]  # blocks appended to the table, or the whole table if reset_blocks
    reset_blocks: bool = False  # the table changed other than by appending (sliding window)
    spec_token_ids: list[int] = field(default_factory=list)
    # Structured outputs: the allowed-token rows the driver's grammar gives this step
    # (engine/executor/grammar_masks.py); None without a grammar.
    grammar_rows: Any = None


@dataclass(slots=True)
class StepDelta:
    new_requests: list[NewRequestData]
    scheduled: list[ScheduledDelta]  # in scheduling order (new requests included)
    num_scheduled_tokens: int
    finished_request_ids: set[str]
    preempted_request_ids: set[str]


@dataclass(slots=True)
class _Sent:
    num_output_tokens: int
    block_ids: list[int]


class StepDeltaBuilder:
    """Driver side: remembers what the ranks know of each live request."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._sent: dict[str, _Sent] = {}
        # Finished / preempted ids of steps that were not sent (nothing scheduled): told
        # with the next step, so no rank keeps a stale mirror of a reused id.
        self._unsent_finished: set[str] = set()
        self._unsent_preempted: set[str] = set()

    def forget(self, scheduler_output: SchedulerOutput) -> None:
        """Takes the bookkeeping of a step that is not sent (it scheduled nothing)."""
        for request_id in scheduler_output.finished_request_ids:
            self._sent.pop(request_id, None)
        for request_id in scheduler_output.preempted_request_ids:
            self._sent.pop(request_id, None)
        self._unsent_finished |= scheduler_output.finished_request_ids
        self._unsent_preempted |= scheduler_output.preempted_request_ids

    def build(self, scheduler_output: SchedulerOutput) -> StepDelta:
        self.forget(scheduler_output)
        finished, self._unsent_finished = self._unsent_finished, set()
        preempted, self._unsent_preempted = self._unsent_preempted, set()
        new_requests: list[NewRequestData] = []
        scheduled: list[ScheduledDelta] = []
        for entry in scheduler_output.scheduled:
            request = entry.request
            sent = self._sent.get(request.request_id)
            if sent is None:
                new_requests.append(
                    NewRequestData(
                        request.request_id,
                        list(request.prompt_token_ids),
                        list(request.output_token_ids),
                        request.sampling_params,
                        request.pooling_params,
                        request.seed,
                        request.rope_length,
                        request.lora_request,
                    )
                )
                sent = self._sent[request.request_id] = _Sent(request.num_output_tokens, [])
            new_output = request.output_token_ids[sent.num_output_tokens :]
            sent.num_output_tokens = request.num_output_tokens
            blocks, known = entry.block_ids, sent.block_ids
            reset = len(blocks) < len(known) or blocks[: len(known)] != known
            rows = None
            if request.structured_output is not None:
                # grammar_masks loads torch; step deltas are plain data built in the driver
                from engine.executor.grammar_masks import grammar_rows

                rows = grammar_rows(entry, self.vocab_size)
            scheduled.append(
                ScheduledDelta(
                    request.request_id,
                    entry.num_computed_tokens,
                    entry.num_new_tokens,
                    list(new_output),
                    list(blocks) if reset else blocks[len(known) :],
                    reset,
                    list(entry.spec_token_ids),
                    rows,
                )
            )
            sent.block_ids = list(blocks)
        return StepDelta(
            new_requests, scheduled, scheduler_output.num_scheduled_tokens, finished, preempted
        )


class RequestMirror:
    """Rank side: the live requests as the ranks' runners need them."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}
        self._block_tables: dict[str, list[int]] = {}

    def apply(self, delta: StepDelta) -> SchedulerOutput:
        for request_id in delta.finished_request_ids | delta.preempted_request_ids:
            self.requests.pop(request_id, None)
            self._block_tables.pop(request_id, None)
        for new in delta.new_requests:
            request = Request(
                new.request_id,
                new.prompt_token_ids,
                new.sampling_params,
                seed=new.seed,
                pooling_params=new.pooling_params,
                lora_request=new.lora_request,
            )
            request.append_output_token_ids(new.output_token_ids)
            request.rope_length = new.rope_length
            self.requests[new.request_id] = request
            self._block_tables[new.request_id] = []
        scheduled = []
        for change in delta.scheduled:
            request = self.requests[change.request_id]
            request.append_output_token_ids(change.new_output_token_ids)
            table = self._block_tables[change.request_id]
            if change.reset_blocks:
                table = self._block_tables[change.request_id] = list(change.block_ids)
            else:
                table.extend(change.block_ids)
            request.structured_output = None
            if change.grammar_rows is not None:
                from engine.executor.grammar_masks import ReplayGrammar

                request.structured_output = ReplayGrammar(change.grammar_rows)
            scheduled.append(
                ScheduledRequest(
                    request,
                    change.num_computed_tokens,
                    change.num_new_tokens,
                    list(table),
                    change.spec_token_ids,
                )
            )
        return SchedulerOutput(
            scheduled,
            delta.num_scheduled_tokens,
            delta.finished_request_ids,
            delta.preempted_request_ids,
        )
