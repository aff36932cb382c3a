"""Rotary position embeddings: the frequencies of every rope type computed in one place, and
the cos/sin every consumer reads (the model's layers, the fused CPU decode step; the
attention backends get keys already rotated). The parameters are parsed torch-free in
engine/config/rope.py. The arithmetic of each type follows
`transformers.modeling_rope_utils` step for step (fp32, same operation order), because the
engine is checked token for token against transformers:

    type       inverse frequencies                                     cos/sin scaled by
    default    theta^(-2i/d)                                           1
    linear     default / factor                                        1
    llama3     long wavelengths / factor, a smooth ramp between        1
    yarn       interpolated / extrapolated, blended over the           attention_factor (from
               beta_fast..beta_slow correction range (`truncate`)      factor, mscale...)
    longrope   1 / (ext_factor_i * theta^(2i/d)), ext = short_factor   attention_factor (from
               or long_factor by the sequence's length (below)         factor or the lengths)
    dynamic    default with theta grown by the sequence's length past  1
               max_position_embeddings (NTK)

**Length-dependent types.** transformers picks longrope's factors and dynamic's theta from
`seq_len = max(position_ids) + 1` of each forward. The engine gives each request a rope
length R, fixed while its K/V are cached (engine/config/rope.py, `RopeRegime`, says how the
scheduler sets it to reproduce transformers' `generate` whatever the chunking, the batch or
a preemption); `cos_sin` gets R per token and scales longrope by R and dynamic by
max(position + 1, R) (docs/engine.md, "Rope scaling").
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.config.rope import RopeParameters, rope_parameters
from engine.layers.ops import OpImpl, apply_rotary_emb, rotary_impl

__all__ = ["RopeParameters", "RotaryEmbedding", "dynamic_inv_freq", "inv_freq", "rope_parameters"]


def inv_freq(
    params: RopeParameters,
    head_dim: int,
    max_position_embeddings: int,
    device: torch.device | None = None,
    long: bool = False,
) -> torch.Tensor:  # [head_dim // 2] fp32
    """The inverse frequencies, as transformers' rope init function of the type
    computes them. `long` picks longrope's long factors; dynamic gives its frequencies
    at (and below) the threshold here, `dynamic_inv_freq` past it."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
    base = params.rope_theta
    s = params.scaling
    if params.rope_type == "longrope":
        ext = torch.tensor(
            s["long_factor"] if long else s["short_factor"], dtype=torch.float32, device=device
        )
        return 1.0 / (ext * base ** (exponents / head_dim))
    if params.rope_type == "yarn":
        return _yarn_inv_freq(params, head_dim, max_position_embeddings, device)
    inv_freq = 1.0 / (base ** (exponents / head_dim))
    if params.rope_type == "linear":
        inv_freq = inv_freq / s["factor"]
    elif params.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, s)
    return inv_freq


def dynamic_inv_freq(
    params: RopeParameters,
    head_dim: int,
    max_position_embeddings: int,
    lengths: torch.Tensor,  # [T] int64, each token's rope length
) -> torch.Tensor:  # [T, head_dim // 2] fp32
    """Dynamic NTK: per token, theta * (factor * n / max_pos - (factor - 1))^(d / (d - 2))
    with n = max(length, max_pos), in fp32 tensor arithmetic as transformers does it."""
    factor = params.scaling["factor"]
    n = torch.clamp(lengths, min=max_position_embeddings)  # int64, as torch.maximum there
    base = params.rope_theta * ((factor * n / max_position_embeddings) - (factor - 1)) ** (
        head_dim / (head_dim - 2)
    )  # [T] fp32
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=lengths.device)
    exponents = exponents.to(dtype=torch.float) / head_dim  # [head_dim // 2]
    return 1.0 / (base[:, None] ** exponents[None, :])


def _yarn_inv_freq(
    params: RopeParameters, head_dim: int, max_position_embeddings: int, device: torch.device | None
) -> torch.Tensor:
    s = params.scaling
    base, dim = params.rope_theta, head_dim
    factor = params.yarn_factor(max_position_embeddings)
    original = s["original_max_position_embeddings"]
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp.to(device=device, dtype=torch.float)
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, a smooth ramp between.

    Wavelengths shorter than original_len / high_freq_factor are kept; longer than
    original_len / low_freq_factor are divided by `factor`; in between they are interpolated.
    """
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_len / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= original_len / high_freq_factor) & (
        wavelen <= original_len / low_freq_factor
    )
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding of any `SUPPORTED_ROPE_TYPES`, as (cos, sin) per token.

    `max_position` is the config's `max_position_embeddings`. The table, [rows, head_dim] =
    (cos | sin) of each frequency in fp32 times the attention factor, is built lazily on the
    device of the first positions it sees, so the module can be created on the meta device.
    Longrope keeps two tables (short factors, then long); dynamic keeps the unscaled one and
    computes the tokens past its threshold from their rope lengths. The consumers (the model's
    layers, the fused CPU decode step, every attention backend after them) see only cos/sin.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None = None,
        impl: OpImpl = "torch",
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}.")
        scaling = dict(rope_scaling or {})
        scaling.pop("rope_theta", None)
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        if rope_type in ("yarn", "longrope", "llama3"):
            scaling.setdefault("original_max_position_embeddings", max_position)
        self.params = params = RopeParameters(float(rope_theta), rope_type, scaling)  # validates
        self.head_dim = head_dim
        self.max_position_embeddings = max_position
        self.rope_type = params.rope_type
        self.length_dependent = params.length_dependent
        self.threshold = params.threshold(max_position)
        # Rows of one table: every position the scaling is made for; dynamic's unscaled table
        # serves only tokens within its threshold.
        self.max_position = (
            max_position
            if self.rope_type == "dynamic"
            else max(max_position, params.max_length(max_position))
        )
        self.attention_factor = params.attention_factor(max_position)
        self._rotate_ = rotary_impl(impl)
        self._cos_sin_cache: torch.Tensor | None = None  # [rows, head_dim] fp32
        # The Triton path gathers cos/sin of a fixed table in one kernel per forward (the
        # length-dependent types still compute theirs): [rows, 2, head_dim] in the model dtype.
        self._gather_table = impl == "triton" and not self.length_dependent
        self._cos_sin_rows: torch.Tensor | None = None

    @classmethod
    def from_parameters(
        cls, head_dim: int, max_position: int, params: RopeParameters, impl: OpImpl = "torch"
    ) -> RotaryEmbedding:
        return cls(
            head_dim,
            max_position,
            params.rope_theta,
            {"rope_type": params.rope_type, **params.scaling},
            impl,
        )

    def rotate_(
        self,
        x: torch.Tensor,  # [num_tokens, num_heads, head_dim], heads contiguous; may be overwritten
        cos: torch.Tensor,  # [num_tokens, 1, head_dim] from `cos_sin`
        sin: torch.Tensor,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """The rotation, in place where the implementation does it: use the return value."""
        return self._rotate_(x, cos, sin)

    def inv_freq(self, device: torch.device | None = None, long: bool = False) -> torch.Tensor:
        return inv_freq(self.params, self.head_dim, self.max_position_embeddings, device, long)

    def _table(self, inv_freq: torch.Tensor, device: torch.device) -> torch.Tensor:
        positions = torch.arange(self.max_position, device=device).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [rows, head_dim // 2]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.attention_factor

    def _cache(self, device: torch.device) -> torch.Tensor:
        cache = self._cos_sin_cache
        if cache is None or cache.device != device:
            cache = self._table(self.inv_freq(device), device)  # [rows, head_dim]
            if self.rope_type == "longrope":  # short rows, then long rows
                cache = torch.cat((cache, self._table(self.inv_freq(device, long=True), device)))
            self._cos_sin_cache = cache
        return cache

    def _rows(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[rows, 2, head_dim]: ((c | c), (-s | s)) per position, in `dtype`: the same values
        `cos_sin` builds per forward from the fp32 table (the cast, then the sign)."""
        rows = self._cos_sin_rows
        if rows is None or rows.device != device or rows.dtype != dtype:
            cos, sin = self._cache(device).to(dtype).chunk(2, dim=-1)  # [rows, d / 2] each
            rows = torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), 1)
            self._cos_sin_rows = rows
        return rows

    def cos_sin(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        dtype: torch.dtype,
        rope_lengths: torch.Tensor | None = None,  # [num_tokens] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for `apply_rotary_emb`, each [num_tokens, 1, head_dim] in `dtype`.

        `rope_lengths`: the rope length R of each token's request (engine/config/rope.py,
        RopeRegime), read by the length-dependent types: longrope scales every token by R,
        dynamic by max(position + 1, R); without it R is the position + 1. Computed once per
        forward and shared by every layer.
        """
        if self._gather_table:
            rows = self._rows(positions.device, dtype)[positions]  # [num_tokens, 2, head_dim]
            return rows[:, :1], rows[:, 1:]
        cache = self._cache(positions.device)
        if not self.length_dependent:
            cos_sin = cache[positions]  # [num_tokens, head_dim]
        else:
            assert self.threshold is not None
            if rope_lengths is None:
                rope_lengths = positions + 1
            if self.rope_type == "longrope":  # the request's regime, all its tokens alike
                cos_sin = cache[positions + (rope_lengths > self.threshold) * self.max_position]
            else:  # dynamic: each token's own length, max(position + 1, R)
                lengths = torch.maximum(positions + 1, rope_lengths)
                cos_sin = self._dynamic_cos_sin(cache, positions, lengths, lengths > self.threshold)
        cos, sin = cos_sin.unsqueeze(1).to(dtype).chunk(2, dim=-1)  # [num_tokens, 1, d / 2]
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def _dynamic_cos_sin(
        self,
        cache: torch.Tensor,
        positions: torch.Tensor,
        lengths: torch.Tensor,
        past: torch.Tensor,
    ) -> torch.Tensor:  # [num_tokens, head_dim]
        """Tokens within the threshold from the table, the others from their own theta
        (computed for every token: no host sync to find which)."""
        within = cache[positions.clamp(max=self.max_position - 1)]
        per_token = dynamic_inv_freq(
            self.params, self.head_dim, self.max_position_embeddings, lengths
        )  # [num_tokens, head_dim // 2]
        freqs = positions.float()[:, None] * per_token
        scaled = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        return torch.where(past[:, None], scaled, within)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        rope_lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, query.dtype, rope_lengths)
        return apply_rotary_emb(query, cos, sin), apply_rotary_emb(key, cos, sin)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, max_position={self.max_position_embeddings}, "
            f"rope_theta={self.params.rope_theta}, rope_type={self.rope_type!r}"
        )
