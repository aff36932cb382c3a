"""`SpeculativeConfig`: vLLM's `speculative_config` dict checked once (n-gram drafts only),
as vLLM keeps its speculative config apart from the engine's other configs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(slots=True)
class SpeculativeConfig:
    """N-gram ("prompt lookup") speculative decoding: drafts are copied from the request's
    own earlier tokens and verified in one forward pass (greedy requests only)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # at most this many drafts per request and step
    prompt_lookup_max: int = 4  # longest suffix n-gram looked up
    prompt_lookup_min: int = 1  # shortest suffix n-gram looked up

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise NotImplementedError(
                f"speculative_config['method']={self.method!r}: only 'ngram' is supported."
            )
        for name in _SPEC_KEYS[1:]:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"speculative_config[{name!r}] must be an int >= 1, got {value!r}."
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config['prompt_lookup_min'] ({self.prompt_lookup_min}) must be "
                f"<= 'prompt_lookup_max' ({self.prompt_lookup_max})."
            )

    @classmethod
    def from_dict(cls, config: dict[str, Any] | None) -> SpeculativeConfig | None:
        """None (speculation off) for None; a ValueError names any unknown key."""
        if config is None:
            return None
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict or None, got {config!r}.")
        for key in config:
            if key not in _SPEC_KEYS:
                raise ValueError(
                    f"speculative_config has unknown key {key!r}; known: {list(_SPEC_KEYS)}."
                )
        if "method" not in config:
            raise ValueError("speculative_config needs 'method' (e.g. 'ngram').")
        return cls(**config)
