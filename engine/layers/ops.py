"""Elementwise model ops: RMSNorm, SiLU-and-mul, rotary embeddings, each with its
implementations and the choice between them made once, when a model is built.

The plain torch functions here (`rms_norm`, `silu_and_mul`, `apply_rotary_emb`) have Hugging
Face numerics and are the `torch` implementation. `select_op_impl` turns the engine's
configuration (attention backend, device, dtype) into one `OpImpl` for the whole model:

    attention_backend   device / dtype     ops
    triton              CUDA               Triton kernels of `kernels/` (the rotation stays
                                           torch: q and k are strided views of the QKV output)
    cpu                 CPU, fp32          native kernels of `engine.native` (one call and one
                                           pass each instead of several torch ops)
    torch, or else      anywhere           torch

The op modules (`RMSNorm`, `SiluAndMul`, `RotaryEmbedding.rotate_`) bind their function at
construction; nothing is decided per call from the tensors' device or a process-wide switch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.rope import RopeParameters

OpImpl = Literal["torch", "native", "triton"]


def select_op_impl(attention_backend: str, device: torch.device, dtype: torch.dtype) -> OpImpl:
    """The implementation every op of a model uses (see the module doc's table)."""
    if attention_backend == "triton" and device.type == "cuda":
        return "triton"
    if attention_backend == "cpu" and device.type == "cpu" and dtype == torch.float32:
        from engine import native

        return "native" if native.native_kernels_available() else "torch"
    return "torch"


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden_size]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Llama RMSNorm in torch. With `residual`, returns (rms_norm(x + residual), x + residual).

    Computed in fp32 and cast back before the weight multiply, as transformers does.
    """
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
    """[num_tokens, 2 * intermediate] (gate | up) -> [num_tokens, intermediate], in torch."""
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


def _rms_norm_impl(impl: OpImpl) -> Callable[..., Any]:
    if impl == "triton":
        from kernels import rms_norm as triton_rms_norm

        return triton_rms_norm
    if impl == "native":
        from engine import native

        return native.rms_norm
    return rms_norm


def _silu_and_mul_impl(impl: OpImpl) -> Callable[[torch.Tensor], torch.Tensor]:
    if impl == "triton":
        from kernels import silu_and_mul as triton_silu_and_mul

        return triton_silu_and_mul
    if impl == "native":
        from engine import native

        return native.silu_and_mul
    return silu_and_mul


def _rotary_impl(impl: OpImpl) -> Callable[..., torch.Tensor]:
    """In place where a kernel does it (native); the callers own `x` and use the result."""
    if impl == "native":
        from engine import native

        return native.rotary_inplace
    return apply_rotary_emb


class RMSNorm(nn.Module):
    """RMSNorm over the last dim of [num_tokens, hidden]; `forward(x, residual)` also adds
    the residual first and returns the sum (one fused call in the kernels)."""

    def __init__(self, hidden_size: int, eps: float, impl: OpImpl = "torch") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.impl = impl
        self._fn = _rms_norm_impl(impl)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._fn(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, impl={self.impl}"


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), all in fp32 and cast back once (torch only:
    the kernels implement the Llama numerics). `forward(x, residual)` adds first, as
    `RMSNorm` does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)  # [T, hidden]
        out = (h * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


class GeluTanhAndMul(nn.Module):
    """GeGLU: gelu_tanh(gate) * up over (gate | up) rows (Gemma's `gelu_pytorch_tanh`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2 * inter] -> [T, inter]
        half = x.shape[-1] // 2
        return F.gelu(x[..., :half], approximate="tanh") * x[..., half:]


class SiluAndMul(nn.Module):
    """[num_tokens, 2 * intermediate] (gate | up) -> [num_tokens, intermediate]."""

    def __init__(self, impl: OpImpl = "torch") -> None:
        super().__init__()
        self.impl = impl
        self._fn = _silu_and_mul_impl(impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x)


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
        impl: OpImpl = "torch",
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}.")
        scaling = dict(rope_scaling or {})
        scaling.pop("rope_theta", None)
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        params = RopeParameters(float(rope_theta), rope_type, scaling)  # validates
        self.head_dim = head_dim
        self.max_position = max_position
        self.rope_theta = params.rope_theta
        self.rope_type = params.rope_type
        self.rope_scaling = params.scaling
        self._rotate_ = _rotary_impl(impl)
        self._cos_sin_cache: torch.Tensor | None = None  # [max_position, head_dim] fp32

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
