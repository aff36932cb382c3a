"""From an `EngineRequest` (engine/core/engine_request.py) to the scheduler's `Request`s.

`RequestBuilder` checks the parameters against the engine, takes the engine's own copy of
them, tokenizes and checks the prompt (`InputProcessor`), and makes one `Request` per sample
(a pooling request is one `Request`) with its prefix-cache salt and its sampling seed. It
registers nothing: the engine hands the requests to the output processor and the scheduler.

Sample `i` of a request with n > 1 is `"<request_id>#<i>"`; its seed is the request's
seed + i, or one drawn from the engine's seeded generator, so an engine started with the
same seed gives unseeded requests the same seeds in the same order.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from engine.api.sampling_params import SamplingParams
from engine.config.resolved import EngineConfig
from engine.core.engine_request import EngineRequest
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

    def check_priority(self, request: EngineRequest) -> None:
        """A priority only under the priority policy (the types are the front's check)."""
        policy = self.config.scheduler_config.policy
        if request.priority != 0 and policy != "priority":
            raise ValueError(
                f"priority={request.priority} needs scheduling_policy='priority' "
                f"(the engine uses {policy!r})."
            )

    def build(self, request: EngineRequest) -> NewRequest:
        """The request's samples, after `check_priority`; raises TypeError/ValueError on bad
        input (the prompt, the params against the model, the cache salt, the grammar, the
        resumed output tokens).

        With `resumed_output_token_ids` (engine/processing/resume.py) only the listed outputs
        become samples, each with its index, its seed and its tokens so far as output."""
        params = request.params
        text, prompt_token_ids = self.input_processor.process(request.prompt, params)
        resumed = request.resumed_output_token_ids
        if resumed is not None and isinstance(params, PoolingParams):
            raise ValueError(f"{RESUME_FIELD} applies to generation, not to pooling requests.")
        salt = self._cache_salt(request.request_id, request.prompt)
        headers = request.trace_headers
        if isinstance(params, PoolingParams):  # the engine's copy, checked and completed
            params = params.clone()
            params.verify(self.config.pooler_config, self.config.model_config)
            pooling = Request.from_engine_request(
                request, prompt_token_ids, params, cache_salt=salt
            )
            return NewRequest(text, prompt_token_ids, params, headers, [pooling])
        params = params.clone()
        params.update_from_generation_config(self.config.model_config.eos_token_ids)
        self.input_processor.process_token_controls(params)
        if params.structured_outputs is not None:
            self.structured_output_manager.validate(params.structured_outputs)
        outputs = self._outputs(params, len(prompt_token_ids), resumed)
        request_id = request.request_id
        seeds = [self._sample_seed(params, index) for index in range(params.n)]
        samples = [
            Request.from_engine_request(
                request,
                prompt_token_ids,
                params,
                cache_salt=salt,
                seed=seeds[index],
                index=index,
                output_token_ids=output_token_ids,
                request_id=request_id if params.n == 1 else f"{request_id}#{index}",
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
