"""The model's rotary-embedding parameters, parsed from a Hugging Face config in one place,
and what the rest of the engine needs to know of them without computing any frequency (the
longest sequence the scaling is made for, the regime a request's prompt length puts it in).

transformers 5 keeps `rope_theta` and the scaling in `config.rope_parameters`; older configs
have `rope_theta` and a `rope_scaling` dict. Every model family reads its rope through
`rope_parameters`, so a new spelling is handled here once. No torch: the engine's
configuration and its KV-cache manager read this; the frequencies and cos/sin of every type
are computed in engine/layers/rope.py.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
# Types whose frequencies depend on the sequence's length, not only on the position.
LENGTH_DEPENDENT_ROPE_TYPES = ("longrope", "dynamic")
# Types whose `max_position_embeddings` is already the long length: no factor stretches it.
UNSTRETCHED_ROPE_TYPES = ("longrope", "llama3")
# Keys each type cannot do without (transformers' validation asks for the same).
_REQUIRED_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "dynamic": ("factor",),
}


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
        missing = [k for k in _REQUIRED_KEYS.get(self.rope_type, ()) if k not in self.scaling]
        if missing:
            raise ValueError(f"rope_type {self.rope_type!r} needs {', '.join(missing)}.")
        partial = self.scaling.get("partial_rotary_factor", 1.0)
        if partial not in (None, 1.0):
            raise NotImplementedError(f"partial_rotary_factor={partial} is not supported.")

    @property
    def length_dependent(self) -> bool:
        return self.rope_type in LENGTH_DEPENDENT_ROPE_TYPES

    def threshold(self, max_position_embeddings: int) -> int | None:
        """The sequence length past which a length-dependent type scales differently:
        longrope's `original_max_position_embeddings`, dynamic's `max_position_embeddings`."""
        if self.rope_type == "longrope":
            return int(self.scaling["original_max_position_embeddings"])
        if self.rope_type == "dynamic":
            return int(max_position_embeddings)
        return None

    def regime(self, rope_length: int, max_position_embeddings: int) -> Hashable | None:
        """What, beside the tokens, the K/V of a request with this rope length depend on.

        None where nothing does (every type but longrope and dynamic, and lengths within the
        threshold: the tokens' scaling depends on their positions alone). Longrope past its
        threshold: every token uses the long factors. Dynamic past it: the tokens within the
        length use theta grown for exactly this length.
        """
        limit = self.threshold(max_position_embeddings)
        if limit is None or rope_length <= limit:
            return None
        return "long" if self.rope_type == "longrope" else rope_length

    def max_length(self, max_position_embeddings: int) -> int:
        """The longest sequence this rope is made for, as vLLM derives `max_model_len`:
        `max_position_embeddings * factor` for every type but longrope and llama3 (whose
        `max_position_embeddings` already is the long length); yarn stretches
        `original_max_position_embeddings` instead. A type without `factor` stretches by 1
        (yarn without one: DeepSeek-style, by max_position / original, see `yarn_factor`)."""
        if self.rope_type in UNSTRETCHED_ROPE_TYPES:
            return int(max_position_embeddings)
        if self.rope_type == "yarn":
            original = int(self.scaling["original_max_position_embeddings"])
            return int(original * float(self.yarn_factor(max_position_embeddings)))
        return int(max_position_embeddings * float(self.scaling.get("factor") or 1.0))

    def attention_factor(self, max_position_embeddings: int) -> float:
        """The factor transformers multiplies cos and sin by (so attention logits by its
        square): yarn's and longrope's, 1 for the others."""
        configured = self.scaling.get("attention_factor")
        if self.rope_type == "yarn":
            factor = self.yarn_factor(max_position_embeddings)
            if configured is not None:
                return float(configured)
            mscale, mscale_all_dim = self.scaling.get("mscale"), self.scaling.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
            return _yarn_mscale(factor)
        if self.rope_type == "longrope":
            if configured is not None:
                return float(configured)
            original = int(self.scaling["original_max_position_embeddings"])
            factor = self.scaling.get("factor") or max_position_embeddings / original
            if factor <= 1.0:
                return 1.0
            return math.sqrt(1 + math.log(factor) / math.log(original))
        return 1.0

    def yarn_factor(self, max_position_embeddings: int) -> float:
        """Yarn's `factor`, or (DeepSeek-style configs) max_position / original."""
        factor = self.scaling.get("factor")
        if factor is None:
            return max_position_embeddings / self.scaling["original_max_position_embeddings"]
        return factor


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


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
    if rope_type in ("yarn", "longrope", "llama3"):
        # As transformers' standardize_rope_params: Phi-3 keeps the pretraining length beside
        # the rope dict, and that one wins; else the dict's, else max_position_embeddings.
        original = getattr(hf_config, "original_max_position_embeddings", None)
        if original is not None and sub_key is None:
            params["original_max_position_embeddings"] = original
        params.setdefault(
            "original_max_position_embeddings", getattr(hf_config, "max_position_embeddings", None)
        )
    return RopeParameters(float(theta), rope_type, params)


def all_rope_parameters(hf_config: Any) -> list[RopeParameters]:
    """Every rope of the model: one, or one per layer type (Gemma 3's dict of dicts)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    sub_keys = [k for k, v in params.items() if isinstance(v, dict)]
    if sub_keys:
        return [rope_parameters(hf_config, k) for k in sub_keys]
    return [rope_parameters(hf_config)]


def derived_max_model_len(hf_config: Any) -> int:
    """The longest sequence the model is made for: the `max_model_len` a user may not
    exceed, derived as vLLM does (`_get_and_verify_max_len`).

    `max_position_embeddings` (2048 without one), stretched by the rope's scaling
    (`RopeParameters.max_length`). Per-layer-type ropes share one stretch (the last type's
    that has one, as vLLM assumes). Gemma 3's `max_position_embeddings` is already the
    scaled length, so it is taken as it is.
    """
    max_pos = int(getattr(hf_config, "max_position_embeddings", None) or 2048)
    if "gemma3" in str(getattr(hf_config, "model_type", "")):
        return max_pos
    derived = max_pos
    for params in all_rope_parameters(hf_config):
        # A type without a factor (default) leaves another layer type's stretch standing.
        if params.rope_type == "yarn" or params.scaling.get("factor"):
            derived = params.max_length(max_pos)
    return derived


def default_max_model_len(hf_config: Any) -> int:
    """The `max_model_len` when none is given (vLLM's default): the derived length, except
    that a longrope model stays within its pretraining length
    (`original_max_position_embeddings`), where its short factors apply."""
    derived = derived_max_model_len(hf_config)
    if any(p.rope_type == "longrope" for p in all_rope_parameters(hf_config)):
        original = getattr(hf_config, "original_max_position_embeddings", None)
        return int(original) if original else derived
    return derived


class RopeRegime:
    """The scheduling side of a rope that scales by the sequence's length (torch-free: the
    scheduler and the KV-cache manager hold it).

    Each request has a *rope length* R (`Request.rope_length`), fixed while its K/V are in
    the cache; the model gives a token at position p the scaling of its rope length (dynamic:
    max(p + 1, R); longrope: R). What transformers does sets R:

    - dynamic (the generic rotary embedding): the prompt's length. The prefill is one
      forward of seq_len = prompt length, each decode step one of seq_len = p + 1, and the
      cached keys keep the theta they were computed with; a recomputation after preemption
      uses the same R, so it recomputes the same K/V.
    - longrope (Phi-3's generation): the sequence's length when its K/V are computed from
      scratch (the prompt's at first). When a sequence computed within the threshold grows
      past it, transformers drops its cache and recomputes every token with the long
      factors; the scheduler does the same (`must_recompute`: the request is preempted and
      recomputed with R = its new length).

    `key(R)` goes into every block hash of the request, so a cached block serves only a
    request whose tokens it was computed for under the same scaling.
    """

    def __init__(self, params: RopeParameters, max_position_embeddings: int) -> None:
        assert params.length_dependent, params.rope_type
        self.params = params
        self.max_position_embeddings = max_position_embeddings
        self.threshold = params.threshold(max_position_embeddings)

    def key(self, rope_length: int) -> Hashable | None:
        regime = self.params.regime(rope_length, self.max_position_embeddings)
        return None if regime is None else (self.params.rope_type, regime)

    def admission_length(self, num_prompt_tokens: int, num_tokens: int) -> int:
        """R of a request scheduled from scratch (new, or recomputed after a preemption)."""
        return num_tokens if self.params.rope_type == "longrope" else num_prompt_tokens

    def must_recompute(self, rope_length: int, num_tokens: int) -> bool:
        """Whether a running request's next step crosses longrope's threshold: its K/V,
        computed with the short factors, are recomputed with the long ones."""
        assert self.threshold is not None
        return self.params.rope_type == "longrope" and rope_length <= self.threshold < num_tokens


def rope_regime(hf_config: Any) -> RopeRegime | None:
    """The model's `RopeRegime`, or None when no rope of the model depends on the
    sequence's length."""
    max_pos = int(getattr(hf_config, "max_position_embeddings", 2048))
    ropes = {p.rope_type: p for p in all_rope_parameters(hf_config) if p.length_dependent}
    if not ropes:
        return None
    distinct = {repr(p) for p in all_rope_parameters(hf_config) if p.length_dependent}
    if len(distinct) > 1:
        raise NotImplementedError(
            "layer types with different length-dependent ropes are not supported "
            f"({sorted(ropes)})."
        )
    return RopeRegime(next(iter(ropes.values())), max_pos)
