"""Sampling parameters for text generation, with vLLM's field names, defaults and checks."""

from __future__ import annotations

import copy
import enum
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.api.structured_outputs import StructuredOutputsParams

# vLLM's per-request logits processor: (output_token_ids, logits[V]) -> logits, or
# (prompt_token_ids, output_token_ids, logits[V]) -> logits. Runs once per row per step, in
# Python: slow; library only (a callable cannot cross gRPC).
LogitsProcessor = Callable[..., Any]

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5
# vLLM's floor for a sampling temperature: below it (and above 0) logits / temperature can
# overflow to inf or nan, so it is raised to this (a warning, once per process).
_MAX_TEMP = 1e-2
_MAX_TEMPERATURE = 2.0  # vLLM's (and OpenAI's) upper bound
_warned_low_temperature = False


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to sample the tokens of one request.

    Field names, defaults and meanings follow vLLM's `SamplingParams`. Invalid values raise
    `ValueError` naming the field.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (token sequences, as vLLM)
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens
    logits_processors: list[LogitsProcessor] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the input processor from bad_words: each word's token ids (with and without
    # a leading space), so the engine bans them without a tokenizer.
    bad_words_token_ids: list[list[int]] | None = None
    # Filled by the engine from the model's generation config: EOS ids that end a request
    # unless `ignore_eos`, and that `min_tokens` keeps from being sampled.
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    _eos_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:  # vLLM: -1 means no seed
            self.seed = None
        self._verify()
        if 0 < self.temperature < _MAX_TEMP:
            _warn_low_temperature(self.temperature)
            self.temperature = _MAX_TEMP
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other sampling knobs have no effect (as in vLLM), once checked.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}.")

        check(_is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(
            _is_finite(self.repetition_penalty) and self.repetition_penalty > 0.0,
            "repetition_penalty",
            "must be a finite number > 0",
        )
        check(
            _is_finite(self.temperature) and 0.0 <= self.temperature <= _MAX_TEMPERATURE,
            "temperature",
            f"must be a number in [0, {_MAX_TEMPERATURE:g}]",
        )
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "must be 0, -1 or a positive int")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(self.seed is None or _is_int(self.seed), "seed", "must be an integer or None")
        check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            "must be an integer >= 1 or None",
        )
        check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        check(
            self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
            "logprobs",
            "must be a non-negative integer or None",
        )
        check(
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
            "prompt_logprobs",
            "must be a non-negative integer or None",
        )
        if any(not isinstance(s, str) or s == "" for s in self.stop):  # type: ignore[union-attr]
            raise ValueError(f"stop cannot contain an empty string, got {self.stop!r}.")
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings are only supported when detokenize is True, "
                f"got stop={self.stop!r} with detokenize=False."
            )
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):  # type: ignore[union-attr]
            raise ValueError(
                f"stop_token_ids must hold non-negative integers, got {self.stop_token_ids!r}."
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")
        self._verify_token_controls()

    def _verify_token_controls(self) -> None:
        """logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens, processors and
        structured outputs (vocabulary bounds are checked by the engine, which knows it)."""
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or not all(
                _is_int(k) and k >= 0 and isinstance(v, int | float) and -100 <= v <= 100
                for k, v in bias.items()
            ):
                raise ValueError(
                    "logit_bias must map non-negative token ids to numbers in [-100, 100], "
                    f"got {bias!r}."
                )
            self.logit_bias = {int(k): float(v) for k, v in bias.items()}
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, list | tuple)
            or not allowed
            or not all(_is_int(t) and t >= 0 for t in allowed)
        ):
            raise ValueError(
                f"allowed_token_ids must be a non-empty list of token ids, got {allowed!r}."
            )
        if self.bad_words is not None and not all(
            isinstance(w, str) and w.strip() for w in self.bad_words
        ):
            raise ValueError(f"bad_words must hold non-blank strings, got {self.bad_words!r}.")
        words = self.bad_words_token_ids
        if words is not None and not all(
            isinstance(w, list) and w and all(_is_int(t) and t >= 0 for t in w) for w in words
        ):
            raise ValueError(
                f"bad_words_token_ids must hold non-empty token-id lists, got {words!r}."
            )
        truncate = self.truncate_prompt_tokens
        if truncate is not None and not (_is_int(truncate) and truncate >= 1):
            raise ValueError(
                f"truncate_prompt_tokens must be an integer >= 1 or None, got {truncate!r}."
            )
        if self.logits_processors is not None and not all(
            callable(f) for f in self.logits_processors
        ):
            raise ValueError("logits_processors must hold callables.")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}."
            )

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    def update_from_generation_config(self, eos_token_ids: set[int]) -> None:
        """Adds the model's EOS ids: they stop generation unless `ignore_eos`."""
        if not self.ignore_eos:
            self._all_stop_token_ids.update(eos_token_ids)
        self._eos_token_ids = set(eos_token_ids)

    @property
    def eos_token_ids(self) -> set[int]:
        return self._eos_token_ids

    def clone(self) -> SamplingParams:
        """A copy that shares nothing the caller or the engine may change later: its lists,
        dicts and sets are its own (the bad words' ids one level down too) and its structured
        outputs a deep copy; numbers, strings and enums are immutable and logits processors
        (callables) are shared. A deep copy of the whole costs ~10x more, per request."""
        new = copy.copy(self)
        for name in _CONTAINER_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(new, name, copy.copy(value))
        if self.bad_words_token_ids is not None:
            new.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
        if self.structured_outputs is not None:
            new.structured_outputs = copy.deepcopy(self.structured_outputs)
        return new


# The fields `clone` copies one level down (lists, dicts, sets of immutable values).
_CONTAINER_FIELDS = (
    "stop",
    "stop_token_ids",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "logits_processors",
    "_all_stop_token_ids",
    "_eos_token_ids",
)


# Sampling fields a model's generation_config.json may set (HF name -> our name).
_GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_config_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword defaults from a model's generation config: the fields it sets
    override vLLM's defaults; `do_sample: false` means greedy."""
    defaults = {
        ours: generation_config[hf]
        for hf, ours in _GENERATION_CONFIG_FIELDS.items()
        if hf in generation_config
    }
    if generation_config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _warn_low_temperature(temperature: float) -> None:
    global _warned_low_temperature
    if not _warned_low_temperature:
        _warned_low_temperature = True
        logger.warning(
            "temperature %s is below %s, which can overflow the scaled logits: raised to %s "
            "(said once)",
            temperature,
            _MAX_TEMP,
            _MAX_TEMP,
        )


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters; `early_stopping` as in transformers (True, False or
    "never"). Scores are the model's log-probabilities: `temperature` is accepted for
    vLLM compatibility and, as in vLLM (raw logprobs), does not reshape them."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> ValueError:
            return ValueError(f"{name} {msg}, got {getattr(self, name)!r}.")

        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= 64:
            raise bad("beam_width", "must be an integer in [1, 64]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be >= 0")
        if self.length_penalty != self.length_penalty:
            raise bad("length_penalty", "must be a number")
        if self.early_stopping not in (True, False, "never"):
            raise bad("early_stopping", 'must be True, False or "never"')
