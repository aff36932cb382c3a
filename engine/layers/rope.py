"""Rotary-embedding parameters, parsed from a Hugging Face config in one place.

transformers 5 keeps `rope_theta` and the scaling in `config.rope_parameters`; older configs
have `rope_theta` and a `rope_scaling` dict. Every model family reads its rope through
`rope_parameters`, so a new spelling is handled here once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeParameters:
    """`rope_type` and its scaling keys (`factor`, `low_freq_factor`...) as one value."""

    rope_theta: float = 10000.0
    rope_type: str = "default"
    scaling: dict[str, Any] = field(default_factory=dict)  # the type's own keys

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise NotImplementedError(
                f"rope_type {self.rope_type!r} is not supported "
                f"({', '.join(SUPPORTED_ROPE_TYPES)})."
            )
        partial = self.scaling.get("partial_rotary_factor", 1.0)
        if partial not in (None, 1.0):
            raise NotImplementedError(f"partial_rotary_factor={partial} is not supported.")


def rope_parameters(hf_config: Any, sub_key: str | None = None) -> RopeParameters:
    """The config's rope as a `RopeParameters`.

    `sub_key` picks one entry of a per-layer-type dict (transformers 5 writes
    ``{"full_attention": {...}, "sliding_attention": {...}}`` for models whose layer types
    use different rope; e.g. Gemma 3).
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if sub_key is not None and isinstance(params.get(sub_key), dict):
        params = dict(params[sub_key])
    legacy = getattr(hf_config, "rope_scaling", None)
    if not params and legacy:
        params = dict(legacy)
    theta = params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    return RopeParameters(float(theta), rope_type, params)
