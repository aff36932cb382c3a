"""One request as the front hands it to the engine: vLLM's `EngineCoreRequest`.

`LLMEngine.add_request` and `AsyncLLMEngine.generate` / `encode` take their options as
keywords (vLLM's signatures); they build one `EngineRequest`, checked, and from there it
travels unchanged: through the engine thread's command queue, to the request builder,
which makes the scheduler's `Request`s from it (`Request.from_engine_request`). A new option
is a field here, not a keyword through every signature on the way.

    generate(prompt, params, id, priority=..., fairness_key=...)   LLMEngine.add_request(...)
                 \\                                                  /
                  EngineRequest.build(...)   (types checked, arrival time, defaults)
                                  |
                  AddCommand -> engine thread -> LLMEngine.add_engine_request
                                  |
                  RequestBuilder.build -> Request.from_engine_request, one per sample
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.api.sampling_params import SamplingParams
from engine.pooling_params import PoolingParams

DEFAULT_KEY = ""  # the fairness key of requests that name none


@dataclass(slots=True, frozen=True)
class EngineRequest:
    """What the caller asked for; the prompt is not tokenized yet (the builder does that,
    on the engine's thread)."""

    request_id: str
    prompt: Any  # engine.processing.input_processor.PromptType: text or a prompt dict
    params: SamplingParams | PoolingParams  # the caller's; the builder takes a copy
    arrival_time: float  # time.time() when the front received it
    lora_request: Any = None  # engine.lora.LoRARequest (kept torch-free here)
    trace_headers: dict[str, str] | None = None  # W3C trace context of the caller
    priority: int = 0  # higher first, under scheduling_policy="priority"
    # {output index: tokens generated so far} of a request resumed from another engine
    # (engine/processing/resume.py); None for a new request.
    resumed_output_token_ids: Mapping[int, Sequence[int]] | None = None
    # Who it is served for (a tenant) and that key's share (engine/core/fairness.py).
    fairness_key: str = DEFAULT_KEY
    fairness_weight: float = 1.0

    @classmethod
    def build(
        cls,
        request_id: Any,
        prompt: Any,
        params: Any,
        arrival_time: float | None = None,
        lora_request: Any = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: Any = 0,
        resumed_output_token_ids: Mapping[int, Sequence[int]] | None = None,
        fairness_key: Any = None,
        fairness_weight: Any = 1.0,
    ) -> EngineRequest:
        """From `add_request`'s arguments; raises TypeError/ValueError naming the field."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}.")
        if not isinstance(params, SamplingParams | PoolingParams):
            raise TypeError(
                f"params must be SamplingParams or PoolingParams, got {type(params).__name__}."
            )
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {priority!r}.")
        if fairness_key is not None and not isinstance(fairness_key, str):
            raise TypeError(f"fairness_key must be a str or None, got {fairness_key!r}.")
        if (
            not isinstance(fairness_weight, int | float)
            or isinstance(fairness_weight, bool)
            or not (fairness_weight > 0 and math.isfinite(fairness_weight))
        ):
            raise ValueError(
                f"fairness_weight must be a positive finite number, got {fairness_weight!r}."
            )
        return cls(
            request_id=request_id,
            prompt=prompt,
            params=params,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            lora_request=lora_request,
            trace_headers=dict(trace_headers) if trace_headers else None,
            priority=priority,
            resumed_output_token_ids=resumed_output_token_ids,
            fairness_key=DEFAULT_KEY if fairness_key is None else fairness_key,
            fairness_weight=float(fairness_weight),
        )
