"""What the engine returns (vLLM's classes): `RequestOutput` with one `CompletionOutput` per
sample for generation, `PoolingRequestOutput` for a pooling (embedding) request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # this module stays importable without torch
    import torch


@dataclass
class Logprob:
    """The log probability of one token, its rank in the distribution and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One sample of a request.

    With `RequestOutputKind.DELTA`, `text`, `token_ids` and `logprobs` hold only what is new
    since the previous output of this request.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's milestones."""

    arrival_time: float
    last_token_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    lora_request: None = None
    kv_transfer_params: dict | None = field(default=None, repr=False)


@dataclass
class PoolingOutput:
    """The pooled vector of one prompt: float32, on the CPU."""

    data: torch.Tensor  # [hidden_size]


@dataclass
class PoolingRequestOutput:
    """The one output of a pooling request, delivered when its prompt has been computed."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt: str | None = None
    metrics: RequestMetrics | None = None
