"""Sampling parameters for text generation, with vLLM's field names, defaults and checks."""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from typing import Any

_SAMPLING_EPS = 1e-5


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
        self._verify()
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
        check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        check(
            self.temperature >= 0.0 and self.temperature == self.temperature,
            "temperature",
            "must be a number >= 0",
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
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}.")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):  # type: ignore[union-attr]
            raise ValueError(
                f"stop_token_ids must hold non-negative integers, got {self.stop_token_ids!r}."
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")

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
        return copy.deepcopy(self)


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
