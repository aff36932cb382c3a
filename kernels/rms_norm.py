"""RMSNorm, optionally fused with the residual add before it (Llama semantics).

    new_residual = x + residual                      (rounded to the model dtype)
    out          = weight * (new_residual / sqrt(mean(new_residual^2) + eps))

The mean and the normalization are computed in fp32; the normalized value is rounded to
the model dtype before the weight multiply, as Hugging Face's `LlamaRMSNorm` does.

Grid: one program per row; the whole hidden dimension is one tile (hidden <= 65536).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    FLOAT_DTYPES,
    check_contiguous,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    next_power_of_2,
)

MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden] (read only when HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden]
    new_residual_ptr,  # [num_tokens, hidden] (written only when HAS_RESIDUAL)
    eps,
    stride_x_token,
    stride_residual_token,
    stride_out_token,
    stride_new_residual_token,
    HIDDEN: tl.constexpr,  # int
    BLOCK: tl.constexpr,  # int, power of two >= HIDDEN
    HAS_RESIDUAL: tl.constexpr,  # bool
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + token * stride_x_token + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(
            residual_ptr + token * stride_residual_token + cols, mask=mask, other=0.0
        )
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + token * stride_new_residual_token + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / HIDDEN
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + token * stride_out_token + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Returns `out`, or `(out, new_residual)` with `new_residual = x + residual` when a
    residual is given. Inputs are not modified; outputs are new contiguous tensors."""
    check_ndim("x", x, 2, "[num_tokens, hidden]")
    check_dtype("x", x, FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    num_tokens, hidden = x.shape
    check_ndim("weight", weight, 1, "[hidden]")
    check_contiguous("weight", weight)
    if weight.shape[0] != hidden or weight.dtype != x.dtype:
        raise ValueError(
            f"weight must be [{hidden}] in {x.dtype}, got {tuple(weight.shape)} {weight.dtype}."
        )
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden must be <= {MAX_HIDDEN}, got {hidden}.")
    if residual is not None:
        check_last_dim_contiguous("residual", residual)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual must match x ({tuple(x.shape)}, {x.dtype}), "
                f"got {tuple(residual.shape)} {residual.dtype}."
            )
        check_same_device(x=x, weight=weight, residual=residual)
    else:
        check_same_device(x=x, weight=weight)

    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out) if residual is not None else out
    if num_tokens > 0:
        block = next_power_of_2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            x_ptr=x,
            residual_ptr=residual if residual is not None else x,
            weight_ptr=weight,
            out_ptr=out,
            new_residual_ptr=new_residual,
            eps=eps,
            stride_x_token=x.stride(0),
            stride_residual_token=residual.stride(0) if residual is not None else 0,
            stride_out_token=out.stride(0),
            stride_new_residual_token=new_residual.stride(0),
            HIDDEN=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=4 if block <= 2048 else (8 if block <= 8192 else 16),
        )
    if residual is not None:
        return out, new_residual
    return out
