"""Elementwise model ops: RMSNorm, SiLU-and-mul, rotary embeddings.

Plain torch functions with Hugging Face Llama numerics. On CUDA, RMSNorm (with its fused
residual add) and SiLU-and-mul dispatch to the Triton kernels in `kernels/`, which follow
the same numerics (tested against these functions' references); the rotation stays in torch
there because q and k are strided views into the fused QKV output. On the CPU in fp32,
RMSNorm, SiLU-and-mul and the rotation (in place) go to the native kernels of
`engine.native` when they are built: one call each instead of several torch ops (and one
pass over the activations instead of several).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine import native


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden_size]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Llama RMSNorm. With `residual`, returns (rms_norm(x + residual), x + residual).

    Computed in fp32 and cast back before the weight multiply, as transformers does.
    """
    if x.is_cuda and x.dim() == 2 and weight.dtype == x.dtype:
        from kernels import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight, eps, residual)
    if _use_native(x, weight) and x.dim() == 2:
        return native.rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = x + residual
        residual = x
    if x.dtype == torch.float32:
        # One fused op; the same math as below when no cast is involved.
        out = F.rms_norm(x, weight.shape, weight, eps)
    else:
        h = x.float()
        variance = h.pow(2).mean(-1, keepdim=True)  # [num_tokens, 1]
        out = weight * (h * torch.rsqrt(variance + eps)).to(x.dtype)
    return out if residual is None else (out, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * intermediate] (gate | up) -> [num_tokens, intermediate]."""
    if x.is_cuda and x.dim() == 2 and x.is_contiguous():
        from kernels import silu_and_mul as triton_silu_and_mul

        return triton_silu_and_mul(x)
    if _use_native(x) and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0:
        return native.silu_and_mul(x)
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def apply_rotary_emb(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]  (cos | cos)
    sin: torch.Tensor,  # [num_tokens, 1, head_dim]  (-sin | sin)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Neox-style rotation: x * cos + rotate_half(x) * sin, with the sign folded into `sin`.

    rotate_half(x) = (-x2 | x1) = swap_halves(x) * (-1 | 1), so with `sin` = (-s | s) the
    rotation is one multiply, one swap and one fused multiply-add.
    """
    head_dim = x.shape[-1]
    swapped = x.unflatten(-1, (2, head_dim // 2)).flip(-2).flatten(-2)  # (x2 | x1)
    return torch.addcmul(x * cos, swapped, sin)


def apply_rotary_emb_(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim], overwritten
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]  (cos | cos)
    sin: torch.Tensor,  # [num_tokens, 1, head_dim]  (-sin | sin)
) -> torch.Tensor:
    """`apply_rotary_emb` in place where a native kernel does it (fp32 CPU, heads contiguous
    within a row, cos/sin contiguous); returns the rotated tensor, which is `x` itself there
    and a new tensor elsewhere. Callers must own `x` and use the return value."""
    if (
        _use_native(x, cos, sin)
        and x.stride(-1) == 1
        and x.stride(-2) == x.shape[-1]
        and cos.is_contiguous()
        and sin.is_contiguous()
    ):
        return native.rotary_inplace(x, cos, sin)
    return apply_rotary_emb(x, cos, sin)


def _use_native(*tensors: torch.Tensor) -> bool:
    """fp32 CPU tensors go to the native kernels when they are built (engine.native)."""
    return (
        all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
        and native.native_kernels_available()
    )


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a cos/sin table over all positions.

    Supported `rope_scaling["rope_type"]`: "default", "linear", "llama3" (the Hugging Face
    `rope_parameters` dict). The table, [max_position, head_dim] = (cos | sin) of each
    frequency in fp32, is built lazily on the device of the first positions it sees, so the
    module can be created on the meta device.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}.")
        self.head_dim = head_dim
        self.max_position = max_position
        self.rope_theta = float(rope_theta)
        self.rope_scaling = dict(rope_scaling or {})
        self.rope_type = self.rope_scaling.get(
            "rope_type", self.rope_scaling.get("type", "default")
        )
        if self.rope_type not in ("default", "linear", "llama3"):
            raise NotImplementedError(
                f"rope_type {self.rope_type!r} is not supported (default, linear, llama3)."
            )
        partial = self.rope_scaling.get("partial_rotary_factor", 1.0)
        if partial not in (None, 1.0):
            raise NotImplementedError(f"partial_rotary_factor={partial} is not supported.")
        self._cos_sin_cache: torch.Tensor | None = None  # [max_position, head_dim] fp32

    def inv_freq(self, device: torch.device | None = None) -> torch.Tensor:  # [head_dim // 2]
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq = 1.0 / (self.rope_theta ** (exponents / self.head_dim))
        if self.rope_type == "linear":
            inv_freq = inv_freq / self.rope_scaling["factor"]
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self.rope_scaling, self.max_position)
        return inv_freq

    def _cache(self, device: torch.device) -> torch.Tensor:
        cache = self._cos_sin_cache
        if cache is None or cache.device != device:
            inv_freq = self.inv_freq(device)  # [head_dim // 2]
            positions = torch.arange(self.max_position, device=device).float()
            freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
            cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, head_dim]
            self._cos_sin_cache = cache
        return cache

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for `apply_rotary_emb`, each [num_tokens, 1, head_dim] in `dtype`.

        Computed once per forward and shared by every layer.
        """
        cos_sin = self._cache(positions.device)[positions]  # [num_tokens, head_dim]
        cos, sin = cos_sin.unsqueeze(1).to(dtype).chunk(2, dim=-1)  # [num_tokens, 1, d / 2]
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, query.dtype)
        return apply_rotary_emb(query, cos, sin), apply_rotary_emb(key, cos, sin)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, max_position={self.max_position}, "
            f"rope_theta={self.rope_theta}, rope_type={self.rope_type!r}"
        )


def _llama3_inv_freq(
    inv_freq: torch.Tensor, scaling: dict[str, Any], max_position: int
) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, a smooth ramp between.

    Wavelengths shorter than original_len / high_freq_factor are kept; longer than
    original_len / low_freq_factor are divided by `factor`; in between they are interpolated.
    """
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original_len = scaling.get("original_max_position_embeddings") or max_position
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_len / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= original_len / high_freq_factor) & (
        wavelen <= original_len / low_freq_factor
    )
    return torch.where(is_medium, smoothed, scaled)
