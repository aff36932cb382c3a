"""Elementwise model ops: RMSNorm, SiLU-and-mul, rotary embeddings, each with its
implementations and the choice between them made once, when a model is built.

The plain torch functions here (`rms_norm`, `silu_and_mul`, `apply_rotary_emb`) have Hugging
Face numerics and are the `torch` implementation. `select_op_impl` turns the engine's
configuration (attention backend, device, dtype) into one `OpImpl` for the whole model:

    attention_backend   device / dtype     ops
    triton              CUDA               Triton kernels of `kernels/` (the rotation reads the
                                           engine's cos/sin: kernels/rotary_kv.py; the triton
                                           backend fuses it with its KV write)
    cpu                 CPU, fp32          native kernels of `engine.native` (one call and one
                                           pass each instead of several torch ops)
    torch, or else      anywhere           torch

The op modules (`RMSNorm`, `SiluAndMul`, and `RotaryEmbedding.rotate_` of engine/layers/rope.py,
where the cos/sin of every rope type are computed) bind their function at construction;
nothing is decided per call from the tensors' device or a process-wide switch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine import native

OpImpl = Literal["torch", "native", "triton"]


def select_op_impl(attention_backend: str, device: torch.device, dtype: torch.dtype) -> OpImpl:
    """The implementation every op of a model uses (see the module doc's table)."""
    if attention_backend == "triton" and device.type == "cuda":
        return "triton"
    if attention_backend == "cpu" and device.type == "cpu" and dtype == torch.float32:
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
        return native.rms_norm
    return rms_norm


def _silu_and_mul_impl(impl: OpImpl) -> Callable[[torch.Tensor], torch.Tensor]:
    if impl == "triton":
        from kernels import silu_and_mul as triton_silu_and_mul

        return triton_silu_and_mul
    if impl == "native":
        return native.silu_and_mul
    return silu_and_mul


def rotary_impl(impl: OpImpl) -> Callable[..., torch.Tensor]:
    """In place where a kernel does it (native, triton); the callers own `x` and use the
    result."""
    if impl == "native":
        return native.rotary_inplace
    if impl == "triton":
        from kernels.rotary_kv import rotary_cos_sin_

        return rotary_cos_sin_
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
