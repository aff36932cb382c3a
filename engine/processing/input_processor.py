"""Input processing for `LLMEngine.add_request`: a prompt (text or token ids) to checked
token ids. Every error names the field and, for limits, the numbers."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from engine.api.bad_words import bad_words_token_ids
from engine.api.sampling_params import SamplingParams
from engine.config.resolved import EngineConfig
from engine.pooling_params import PoolingParams

PromptType = str | Mapping[str, Any]


class InputProcessor:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        get_tokenizer: Callable[[], Any],
        get_stop_tokenizer: Callable[[], Any] | None = None,
    ) -> None:
        self.config = config
        self.num_blocks = num_blocks  # the KV-cache size, decided once by the model runner
        self._get_tokenizer = get_tokenizer
        # Stop strings are matched with this one (engine/processing/stop_tokenizer.py).
        self._get_stop_tokenizer = get_stop_tokenizer or get_tokenizer

    def process(
        self, prompt: PromptType, params: SamplingParams | PoolingParams
    ) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids); raises TypeError/ValueError on bad input."""
        text, prompt_token_ids = self._tokens(prompt)
        if isinstance(params, SamplingParams) and params.truncate_prompt_tokens:
            prompt_token_ids = prompt_token_ids[-params.truncate_prompt_tokens :]
        self._validate(prompt_token_ids, params)
        return text, prompt_token_ids

    def process_token_controls(self, params: SamplingParams) -> None:
        """Checks token ids against the vocabulary; tokenizes `bad_words` when the caller
        has not (the gRPC path sends their token ids)."""
        vocab = self.config.model_config.vocab_size
        check_in_vocab("stop_token_ids", params.stop_token_ids or [], vocab)
        check_in_vocab("allowed_token_ids", params.allowed_token_ids or [], vocab)
        for token_id in params.logit_bias or {}:
            if not 0 <= token_id < vocab:
                raise ValueError(
                    f"logit_bias holds token id {token_id}, not in the vocabulary [0, {vocab})."
                )
        for i, ids in enumerate(params.bad_words_token_ids or []):
            check_in_vocab(f"bad_words_token_ids[{i}]", ids, vocab)
        if params.stop and params.detokenize:
            self._get_stop_tokenizer()  # a ValueError naming `stop` when there is none
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = bad_words_token_ids(
                self._get_tokenizer(), params.bad_words
            )

    def _tokens(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty.")
            return prompt, list(self._get_tokenizer()(prompt).input_ids)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list | tuple) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids
                ):
                    raise TypeError("prompt_token_ids must be a list of ints.")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return self._tokens(prompt["prompt"])
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'.")
        raise TypeError(
            f"prompt must be a str or a dict with 'prompt_token_ids', got {type(prompt).__name__}."
        )

    def _validate(
        self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams
    ) -> None:
        num = len(prompt_token_ids)
        model_config = self.config.model_config
        if num == 0:
            raise ValueError("prompt_token_ids must not be empty (0 prompt tokens).")
        check_in_vocab("prompt_token_ids", prompt_token_ids, model_config.vocab_size)
        if num > model_config.max_model_len:
            raise ValueError(
                f"The prompt (length {num}) is longer than the maximum model length "
                f"of {model_config.max_model_len} (max_model_len)."
            )
        block_size = self.config.cache_config.block_size
        num_blocks = self.num_blocks
        if math.ceil(num / block_size) > num_blocks:
            raise ValueError(
                f"The prompt (length {num}) needs {math.ceil(num / block_size)} KV-cache "
                f"blocks of {block_size} tokens, but the whole cache has {num_blocks} blocks "
                f"({num_blocks * block_size} tokens): it could never be scheduled."
            )
        if isinstance(params, PoolingParams):
            return
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > model_config.max_logprobs:
                raise ValueError(
                    f"{name}={value} exceeds max_logprobs={model_config.max_logprobs}."
                )


def check_in_vocab(name: str, token_ids: list[int], vocab_size: int) -> None:
    """Raises ValueError naming the first id outside [0, vocab_size) by its index."""
    for i, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise ValueError(
                f"{name}[{i}] = {token_id} is not in the vocabulary [0, {vocab_size})."
            )
