"""Turns the scheduler's per-step updates into `RequestOutput`s.

Owns what is about text and presentation: incremental detokenization, stop strings,
logprob dicts, the output kind (cumulative / delta / final only) and gathering the `n`
samples of a request back under the caller's request id. A pooling request gets one
`PoolingRequestOutput`, when its prompt has been pooled (none if it is aborted).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.api.detokenizer import IncrementalDetokenizer
from engine.api.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from engine.api.sampling_params import RequestOutputKind, SamplingParams
from engine.core.request import Request, RequestStatus
from engine.core.sched_output import LogprobsLists, ModelRunnerOutput

_FINISHED = RequestStatus.FINISHED_STOPPED  # the first finished status (an ordered enum)


@dataclass
class _SampleState:
    """One of a request's n samples."""

    request: Request
    detokenizer: IncrementalDetokenizer | None
    logprobs: SampleLogprobs | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_processed_tokens: int = 0  # tokens already detokenized
    num_sent_tokens: int = 0  # tokens already delivered (DELTA)
    num_sent_chars: int = 0
    num_sent_logprobs: int = 0
    changed: bool = False


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_SampleState]
    prompt_logprobs: PromptLogprobs | None
    num_sent_prompt_logprobs: int = 0
    sent_final: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


@dataclass
class _PoolingState:
    request: Request
    prompt: str | None


class OutputProcessor:
    def __init__(
        self, tokenizer: Any | None, get_stop_tokenizer: Callable[[], Any] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        # For stop strings when the engine has no tokenizer (engine/processing/stop_tokenizer.py).
        self._get_stop_tokenizer = get_stop_tokenizer
        self.parents: dict[str, _ParentState] = {}
        self._parent_of: dict[str, str] = {}  # sample request id -> parent request id
        self.pooling: dict[str, _PoolingState] = {}  # request id -> live pooling request
        # Samples whose steps deliver nothing until they finish (see `_is_quiet`): a step
        # passes over them (vLLM builds outputs only for the requests that need one).
        self._quiet: set[str] = set()

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        samples: list[Request],
    ) -> None:
        states = [self._new_sample_state(r, prompt_token_ids) for r in samples]
        prompt_logprobs: PromptLogprobs | None = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None]  # the first prompt token has no logprob
        self.parents[request_id] = _ParentState(
            request_id, prompt, prompt_token_ids, params, states, prompt_logprobs
        )
        for r, state in zip(samples, states):
            self._parent_of[r.request_id] = request_id
            if _is_quiet(state, params):
                self._quiet.add(r.request_id)

    def add_pooling_request(self, prompt: str | None, request: Request) -> None:
        self.pooling[request.request_id] = _PoolingState(request, prompt)

    def _new_sample_state(self, request: Request, prompt_token_ids: list[int]) -> _SampleState:
        params = request.sampling_params
        assert params is not None
        detokenizer = None
        tokenizer = self.tokenizer
        if tokenizer is None and params.stop and self._get_stop_tokenizer is not None:
            tokenizer = self._get_stop_tokenizer()
        if tokenizer is not None and params.detokenize:
            detokenizer = IncrementalDetokenizer(
                tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=params.stop,  # type: ignore[arg-type]
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        wants_logprobs = params.logprobs is not None
        state = _SampleState(
            request, detokenizer, [] if wants_logprobs else None, 0.0 if wants_logprobs else None
        )
        if request.num_output_tokens:
            self._resume_sample(state)
        return state

    @staticmethod
    def _resume_sample(sample: _SampleState) -> None:
        """A resumed sample (engine/processing/resume.py) starts as if its tokens so far had been
        processed and delivered here: their text is output but no stop string is looked for
        in it, and a DELTA stream goes on from where the caller's left off (including the
        text held back as the possible start of a stop string)."""
        request = sample.request
        sample.num_processed_tokens = sample.num_sent_tokens = request.num_output_tokens
        if sample.detokenizer is not None:
            sample.detokenizer.append_resumed(request.output_token_ids)
            sample.num_sent_chars = len(sample.detokenizer.get_text(finished=False))

    def has_request(self, request_id: str) -> bool:
        return request_id in self.parents or request_id in self.pooling

    def sample_ids(self, request_id: str) -> list[str]:
        if request_id in self.pooling:
            return [request_id]
        return [s.request.request_id for s in self.parents[request_id].samples]

    # ---- per step ---------------------------------------------------------------------

    def process(
        self, updated: list[Request], runner_output: ModelRunnerOutput
    ) -> tuple[list[RequestOutput | PoolingRequestOutput], list[str]]:
        """Returns this step's outputs and the sample ids a stop string has finished (the
        caller finishes them in the scheduler)."""
        stopped_by_string: list[str] = []
        touched: dict[str, _ParentState] = {}
        pooled: list[PoolingRequestOutput] = []
        quiet = self._quiet
        for request in updated:
            if request.status < _FINISHED and request.request_id in quiet:
                continue  # nothing to deliver: its tokens are taken in when it finishes
            if request.is_pooling:
                pooling_output = self._pooling_output(request, runner_output)
                if pooling_output is not None:
                    pooled.append(pooling_output)
                continue
            parent = self.parents.get(self._parent_of.get(request.request_id, ""))
            if parent is None:
                continue
            touched[parent.request_id] = parent
            first = parent.samples[0]
            sample = (
                first
                if first.request is request
                else next(s for s in parent.samples if s.request is request)
            )
            prompt_lp = runner_output.prompt_logprobs.get(request.request_id)
            if prompt_lp is not None and sample is parent.samples[0]:
                self._add_prompt_logprobs(parent, *prompt_lp)
            has_news = request.num_output_tokens > sample.num_processed_tokens
            if (has_news or request.is_finished()) and self._update_sample(
                sample, runner_output.logprobs.get(request.request_id)
            ):
                stopped_by_string.append(request.request_id)
        outputs: list[RequestOutput | PoolingRequestOutput] = [
            out for p in touched.values() if (out := self._make_output(p)) is not None
        ]
        outputs.extend(pooled)
        return outputs, stopped_by_string

    def _pooling_output(
        self, request: Request, runner_output: ModelRunnerOutput
    ) -> PoolingRequestOutput | None:
        data = runner_output.pooled.get(request.request_id)
        state = self.pooling.get(request.request_id)
        if data is None or state is None or state.request is not request:
            return None
        del self.pooling[request.request_id]
        return PoolingRequestOutput(
            request_id=request.request_id,
            outputs=PoolingOutput(data=data),
            prompt_token_ids=request.prompt_token_ids,
            finished=True,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            prompt=state.prompt,
            metrics=_metrics([request]),
        )

    def _update_sample(self, sample: _SampleState, logprobs: LogprobsLists | None) -> bool:
        """Takes in the sample's tokens since the last call (and this step's logprobs);
        returns whether a stop string finished it here (the scheduler has yet to)."""
        request = sample.request
        sample.changed = True
        new_ids = request.output_token_ids[sample.num_processed_tokens :]
        sample.num_processed_tokens = request.num_output_tokens
        if sample.logprobs is not None and logprobs is not None:
            self._add_logprobs(sample, logprobs)
        stopped = False
        if sample.detokenizer is not None and new_ids and sample.finish_reason is None:
            stop = sample.detokenizer.update(new_ids)
            if stop is not None:
                sample.finish_reason, sample.stop_reason = "stop", stop
                stopped = not request.is_finished()
        if request.is_finished() and sample.finish_reason is None:
            sample.finish_reason = request.get_finished_reason()
            sample.stop_reason = request.stop_reason
        return stopped

    def _add_logprobs(self, sample: _SampleState, lists: LogprobsLists) -> None:
        assert sample.logprobs is not None and sample.cumulative_logprob is not None
        for ids, values, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
            sample.logprobs.append(self._logprob_dict(ids, values, rank))
            sample.cumulative_logprob += values[0]

    def _add_prompt_logprobs(self, parent: _ParentState, start: int, lists: LogprobsLists) -> None:
        """`start` is the position of the first token the lists cover; positions already
        recorded (recomputed after a preemption) are skipped."""
        assert parent.prompt_logprobs is not None
        for offset, (ids, values, rank) in enumerate(
            zip(lists.token_ids, lists.logprobs, lists.ranks)
        ):
            if start + offset == len(parent.prompt_logprobs):
                parent.prompt_logprobs.append(self._logprob_dict(ids, values, rank))

    def _logprob_dict(self, ids: list[int], values: list[float], rank: int) -> dict[int, Logprob]:
        result: dict[int, Logprob] = {}
        for i, (token_id, value) in enumerate(zip(ids, values)):
            if token_id in result:
                continue  # the chosen token is also among the top-k
            result[token_id] = Logprob(value, rank if i == 0 else i, self._decode_one(token_id))
        return result

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    # ---- building RequestOutput ---------------------------------------------------------

    def _make_output(self, parent: _ParentState) -> RequestOutput | None:
        kind = parent.params.output_kind
        finished = parent.finished
        if parent.sent_final or (kind == RequestOutputKind.FINAL_ONLY and not finished):
            return None
        samples = parent.samples
        if kind == RequestOutputKind.DELTA:  # the changed samples only (nothing new in others)
            samples = [s for s in samples if s.changed]
        completions = [self._completion(s, s.request.index, kind) for s in samples]
        for s in parent.samples:
            s.changed = False
        prompt_logprobs = parent.prompt_logprobs
        if kind == RequestOutputKind.DELTA and prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs[parent.num_sent_prompt_logprobs :]
            parent.num_sent_prompt_logprobs += len(prompt_logprobs)
        if finished:
            parent.sent_final = True
            self._forget(parent)
        first = parent.samples[0].request
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            metrics=_metrics([s.request for s in parent.samples]),
            num_cached_tokens=max(first.num_cached_tokens, 0),
        )

    def _completion(self, sample: _SampleState, index: int, kind: RequestOutputKind):
        request = sample.request
        finished = sample.finish_reason is not None
        text = sample.detokenizer.get_text(finished) if sample.detokenizer else ""
        token_ids = request.output_token_ids
        logprobs = sample.logprobs
        if kind == RequestOutputKind.DELTA:
            text = text[sample.num_sent_chars :]
            token_ids = token_ids[sample.num_sent_tokens :]
            if logprobs is not None:
                logprobs = logprobs[sample.num_sent_logprobs :]
        sample.num_sent_chars += len(text) if kind == RequestOutputKind.DELTA else 0
        sample.num_sent_tokens = request.num_output_tokens
        sample.num_sent_logprobs = len(sample.logprobs or [])
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=sample.cumulative_logprob,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )

    # ---- aborts -------------------------------------------------------------------------

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Marks every unfinished sample aborted; returns the final output to deliver (none
        for a pooling request: it has nothing to report)."""
        if self.pooling.pop(request_id, None) is not None:
            return None
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for sample in parent.samples:
            if sample.finish_reason is None:
                if sample.request.request_id in self._quiet:
                    self._update_sample(sample, None)  # the text of its tokens so far
                sample.finish_reason = "abort"
                sample.changed = True
        return self._make_output(parent)

    def _forget(self, parent: _ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for sample in parent.samples:
            self._parent_of.pop(sample.request.request_id, None)
            self._quiet.discard(sample.request.request_id)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents) + len(self.pooling)


def _is_quiet(sample: _SampleState, params: SamplingParams) -> bool:
    """Whether a sample's steps deliver nothing until it finishes: a FINAL_ONLY output with
    no logprobs or prompt logprobs to gather per step and no stop string to look for. Its
    tokens are detokenized when it finishes (or is aborted), all at once: the incremental
    detokenizer takes them one by one either way, so the text is the same."""
    return (
        params.output_kind == RequestOutputKind.FINAL_ONLY
        and sample.logprobs is None
        and params.prompt_logprobs is None
        and not params.stop
    )


def _metrics(requests: list[Request]) -> RequestMetrics:
    """One request's metrics, over its samples."""
    if len(requests) == 1:  # n = 1, every step of a stream: the same values, directly
        request = requests[0]
        t = request.times
        scheduled = t.first_scheduled_time
        return RequestMetrics(
            arrival_time=t.arrival_time,
            last_token_time=t.last_token_time or t.arrival_time,
            first_scheduled_time=scheduled,
            first_token_time=t.first_token_time,
            time_in_queue=None if scheduled is None else scheduled - t.arrival_time,
            finished_time=t.finished_time,
            num_preemptions=request.num_preemptions,
        )
    times = [r.times for r in requests]
    first = times[0]

    def earliest(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return min(present) if present else None

    scheduled = earliest([t.first_scheduled_time for t in times])
    finished = [t.finished_time for t in times]
    last_token = max((t.last_token_time or first.arrival_time) for t in times)
    return RequestMetrics(
        arrival_time=first.arrival_time,
        last_token_time=last_token,
        first_scheduled_time=scheduled,
        first_token_time=earliest([t.first_token_time for t in times]),
        time_in_queue=None if scheduled is None else scheduled - first.arrival_time,
        finished_time=max(finished) if all(f is not None for f in finished) else None,  # type: ignore[type-var]
        num_preemptions=sum(r.num_preemptions for r in requests),
    )
