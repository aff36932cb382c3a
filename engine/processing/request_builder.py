"""From `LLMEngine.add_request`'s arguments to the scheduler's `Request`s.

`RequestBuilder` checks the parameters, takes the engine's own copy of them, tokenizes and
checks the prompt (`InputProcessor`), and makes one `Request` per sample (a pooling
request is one `Request`) with its prefix-cache salt and its sampling seed. It registers
nothing: the engine hands the requests to the output processor and the scheduler.

Sample `i` of a request with n > 1 is `"<request_id>#<i>"`; its seed is the request's
seed + i, or one drawn from the engine's seeded generator, so an engine started with the
same seed gives unseeded requests the same seeds in the same order.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.api.sampling_params import SamplingParams
from engine.config.engine_config import EngineConfig
from engine.core.fairness import DEFAULT_KEY
from engine.core.request import Request
from engine.pooling_params import PoolingParams
from engine.processing.input_processor import InputProcessor, PromptType
from engine.processing.resume import FIELD as RESUME_FIELD
from engine.processing.resume import ResumedOutputTokenIds, check_resumed_output_token_ids
from engine.structured_output.manager import StructuredOutputManager

_SEED_MASK = (1 << 63) - 1


@dataclass(slots=True)
class NewRequest:
    """One `add_request` call, built: its samples share the prompt, params and headers."""

    text: str | None  # the prompt's text, None when token ids were given
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # the engine's checked copy
    trace_headers: dict[str, str] | None
    samples: list[Request]  # one per sample; one for a pooling request


class RequestBuilder:
    def __init__(
        self,
        config: EngineConfig,
        input_processor: InputProcessor,
        structured_output_manager: StructuredOutputManager,
    ) -> None:
        self.config = config
        self.input_processor = input_processor
        self.structured_output_manager = structured_output_manager
        self._seed_rng = random.Random(config.model_config.seed)
        self._salt_counter = 0

    def check_params(self, params: Any, priority: Any) -> None:
        """The parameter and priority types, and a priority only under the priority policy."""
        if not isinstance(params, SamplingParams | PoolingParams):
            raise TypeError(
                f"params must be SamplingParams or PoolingParams, got {type(params).__name__}."
            )
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {priority!r}.")
        if priority != 0 and self.config.scheduler_config.policy != "priority":
            raise ValueError(
                f"priority={priority} needs scheduling_policy='priority' "
                f"(the engine uses {self.config.scheduler_config.policy!r})."
            )

    @staticmethod
    def check_fairness(fairness_key: Any, fairness_weight: Any) -> str:
        """The key (None: the default key) and its weight, a positive finite number."""
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
        return DEFAULT_KEY if fairness_key is None else fairness_key

    def build(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None,
        lora_request: Any,
        trace_headers: Mapping[str, str] | None,
        priority: int,
        *,
        resumed_output_token_ids: ResumedOutputTokenIds | None = None,
        fairness_key: str = DEFAULT_KEY,
        fairness_weight: float = 1.0,
    ) -> NewRequest:
        """The request's samples, after `check_params`; raises TypeError/ValueError on bad
        input (the prompt, the params against the model, the cache salt, the grammar, the
        resumed output tokens).

        With `resumed_output_token_ids` (engine/processing/resume.py) only the listed outputs become
        samples, each with its index, its seed and its tokens so far as output."""
        text, prompt_token_ids = self.input_processor.process(prompt, params)
        if resumed_output_token_ids is not None and isinstance(params, PoolingParams):
            raise ValueError(f"{RESUME_FIELD} applies to generation, not to pooling requests.")
        if isinstance(params, PoolingParams):  # the engine's copy, checked and completed
            params = params.clone()
            params.verify(self.config.pooler_config, self.config.model_config)
        salt = self._cache_salt(request_id, prompt)
        arrival = arrival_time if arrival_time is not None else time.time()
        headers = dict(trace_headers) if trace_headers else None
        common = dict(
            arrival_time=arrival,
            priority=priority,
            cache_salt=salt,
            trace_headers=headers,
            lora_request=lora_request,
            fairness_key=fairness_key,
            fairness_weight=float(fairness_weight),
        )
        if isinstance(params, PoolingParams):
            pooling = Request(request_id, prompt_token_ids, None, pooling_params=params, **common)
            return NewRequest(text, prompt_token_ids, params, headers, [pooling])
        params = params.clone()
        params.update_from_generation_config(self.config.model_config.eos_token_ids)
        self.input_processor.process_token_controls(params)
        if params.structured_outputs is not None:
            self.structured_output_manager.validate(params.structured_outputs)
        outputs = self._outputs(params, len(prompt_token_ids), resumed_output_token_ids)
        seeds = [self._sample_seed(params, index) for index in range(params.n)]
        samples = [
            Request(
                request_id if params.n == 1 else f"{request_id}#{index}",
                prompt_token_ids,
                params,
                seed=seeds[index],
                parent_id=request_id,
                index=index,
                output_token_ids=output_token_ids,
                **common,
            )
            for index, output_token_ids in outputs.items()
        ]
        return NewRequest(text, prompt_token_ids, params, headers, samples)

    def _outputs(
        self,
        params: SamplingParams,
        num_prompt_tokens: int,
        resumed: ResumedOutputTokenIds | None,
    ) -> dict[int, list[int]]:
        """Output index -> its tokens so far: all n outputs, empty, for a new request; the
        listed ones for a resumed request, whose prompt logprobs are not recomputed (they
        went out with the first token, before the request could move)."""
        if resumed is None:
            return {index: [] for index in range(params.n)}
        config = self.config
        checked = check_resumed_output_token_ids(
            resumed,
            params,
            num_prompt_tokens,
            vocab_size=config.model_config.vocab_size,
            max_model_len=config.model_config.max_model_len,
            max_tokens_in_cache=self.input_processor.num_blocks * config.cache_config.block_size,
        )
        params.prompt_logprobs = None
        return checked

    def _cache_salt(self, request_id: str, prompt: PromptType) -> str | None:
        """vLLM's `cache_salt` in the prompt dict: prompts with different salts never share
        prefix-cache blocks (the services salt by tenant)."""
        salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
        if salt is not None and not isinstance(salt, str):
            raise TypeError(f"cache_salt must be a str, got {type(salt).__name__}.")
        salt = salt or None  # "" is no salt
        if not self.config.cache_config.enable_prefix_caching:
            # Without prefix caching only the n samples of this prompt share blocks.
            self._salt_counter += 1
            salt = f"{salt or ''}/{request_id}/{self._salt_counter}"
        return salt

    def _sample_seed(self, params: SamplingParams, index: int) -> int:
        if params.seed is not None:
            return (params.seed + index) & _SEED_MASK
        return self._seed_rng.getrandbits(63)
