"""A request as the scheduler sees it: token ids and counters, no torch."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.api.sampling_params import SamplingParams
from engine.core.engine_request import EngineRequest
from engine.pooling_params import PoolingParams


class RequestStatus(enum.IntEnum):
    """Ordered: everything after PREEMPTED is a finished state."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class RequestTimes:
    """Wall-clock times (time.time()) of a request's milestones; None until reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    preemption_times: list[float] = field(default_factory=list)


class Request:
    """One sequence to generate. `n > 1` is fanned out into one Request per sample.

    `num_computed_tokens` counts tokens whose keys/values are in the cache (or are being
    written by the step in flight). `all_token_ids` is the prompt followed by the output.

    `output_token_ids` given at construction are output generated before this engine saw
    the request (a resumed request); they are computed into the cache as a prefill.

    A pooling request has `pooling_params` and no `sampling_params`: it is prefill only and
    finishes when its last prompt token has been computed.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        arrival_time: float | None = None,
        priority: int = 0,
        seed: int = 0,
        cache_salt: str | None = None,
        parent_id: str | None = None,
        index: int = 0,
        trace_headers: dict[str, str] | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: Any = None,  # engine.lora.LoRARequest (kept torch-free here)
        output_token_ids: Sequence[int] = (),
        fairness_key: str = "",
        fairness_weight: float = 1.0,
    ) -> None:
        if (sampling_params is None) == (pooling_params is None):
            raise ValueError("A request needs exactly one of sampling_params and pooling_params.")
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index  # which of the parent's n samples this is
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)  # read per row per step: no property
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        # Read by every step's runner and output processor: a plain attribute, not a
        # property (the parameters never change).
        self.is_pooling = pooling_params is not None
        self.priority = priority
        # Who the request is served for (the tenant), and that key's share: the scheduler
        # shares the batch fairly between keys (engine.core.fairness); "" is the default key.
        self.fairness_key = fairness_key
        self.fairness_weight = fairness_weight
        self.trace_headers = trace_headers  # W3C trace context of the caller, if any
        self.lora_request = lora_request
        # Seed of the counter-based sampler: fixed per request, so a request samples the
        # same tokens whatever else shares its batch.
        self.seed = seed
        # Extra key mixed into the prefix-cache hashes: requests with different salts never
        # share blocks (used to limit sharing to siblings when prefix caching is off).
        self.cache_salt = cache_salt
        self.times = RequestTimes(arrival_time if arrival_time is not None else time.time())
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Output generated so far; non-empty at arrival for a request resumed from another
        # engine (engine/processing/resume.py): those tokens are output for every limit, penalty and
        # the sampler's position, and are recomputed into the cache like a preempted one's.
        self.output_token_ids: list[int] = list(output_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids) + self.output_token_ids
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 = not yet
        self.num_preemptions = 0
        # The sequence length a rope scaled by the length (longrope, dynamic) scales this
        # request's K/V for; set by the scheduler when it computes them from scratch
        # (engine/config/rope.py, RopeRegime).
        self.rope_length = len(prompt_token_ids)
        # Chained hashes of the full blocks of all_token_ids, kept by the KV-cache manager.
        self.block_hashes: list[int] = []
        # Draft tokens scheduled for verification this step (speculative decoding): not in
        # all_token_ids; cleared when the step's tokens are appended or on preemption.
        self.spec_token_ids: list[int] = []
        # Async scheduling: tokens sampled by steps in flight, not yet appended (each has
        # its KV slot allocated; engine/core/async_scheduling.py).
        self.num_output_placeholders = 0
        # Structured outputs: the grammar state (engine.structured_output.request), set by
        # the engine for a constrained request; the scheduler only calls its methods.
        self.structured_output: Any = None
        # The scheduler's cached stop screen (engine/core/stop.py, `stop_screen`): the
        # output count of the length cap and the stop token ids; set at its first token.
        self.stop_screen: tuple[int, set[int]] | None = None

    @classmethod
    def from_engine_request(
        cls,
        request: EngineRequest,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        *,
        cache_salt: str | None,
        seed: int = 0,
        index: int = 0,
        output_token_ids: Sequence[int] = (),
        request_id: str | None = None,
    ) -> Request:
        """Sample `index` of `request` (vLLM's `Request.from_engine_core_request`): its
        options as the front gave them; `params` is the engine's checked copy, `request_id`
        the sample's id (the request's own unless n > 1)."""
        sampling = params if isinstance(params, SamplingParams) else None
        return cls(
            request_id if request_id is not None else request.request_id,
            prompt_token_ids,
            sampling,
            arrival_time=request.arrival_time,
            priority=request.priority,
            seed=seed,
            cache_salt=cache_salt,
            parent_id=request.request_id,
            index=index,
            trace_headers=request.trace_headers,
            pooling_params=params if sampling is None else None,
            lora_request=request.lora_request,
            output_token_ids=output_token_ids,
            fairness_key=request.fairness_key,
            fairness_weight=request.fairness_weight,
        )

    @property
    def arrival_time(self) -> float:
        return self.times.arrival_time

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens if self.sampling_params is not None else 0

    @property
    def needs_all_prompt_positions(self) -> bool:
        """Whether every prompt position must be computed here, so that no prefix-cache hit
        may stand in for one: MEAN and CLS pooling read every position's hidden state,
        prompt logprobs every position's logits (LAST pooling reads only the last token's,
        which is always computed)."""
        if self.pooling_params is not None:
            return self.pooling_params.skip_reading_prefix_cache
        params = self.sampling_params
        return params is not None and params.prompt_logprobs is not None

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def is_ready(self) -> bool:
        """Whether it may be scheduled: false while its grammar is still compiling."""
        return self.structured_output is None or self.structured_output.is_ready()

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
