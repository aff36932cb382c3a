"""SiLU-and-mul, the gated activation of Llama's MLP.

    x:   [num_tokens, 2 * intermediate] = [gate | up]
    out: [num_tokens, intermediate]     = silu(gate) * up

Grid: (num_tokens, cdiv(intermediate, BLOCK)); the math runs in fp32 and rounds once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    FLOAT_DTYPES,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    next_power_of_2,
)

MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_tokens, 2 * intermediate]
    out_ptr,  # [num_tokens, intermediate]
    stride_x_token,
    stride_out_token,
    INTERMEDIATE: tl.constexpr,  # int
    BLOCK: tl.constexpr,  # int, power of two
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    row = x_ptr + token * stride_x_token
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + INTERMEDIATE + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + token * stride_out_token + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, intermediate]
    """Returns silu(x[:, :I]) * x[:, I:] for x [num_tokens, 2 * I], as a new tensor."""
    check_ndim("x", x, 2, "[num_tokens, 2 * intermediate]")
    check_dtype("x", x, FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    num_tokens, width = x.shape
    if width % 2 != 0:
        raise ValueError(f"x's last dimension must be even (gate | up), got {width}.")
    check_same_device(x=x)
    intermediate = width // 2
    out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or intermediate == 0:
        return out
    block = min(MAX_BLOCK, next_power_of_2(intermediate))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
        x_ptr=x,
        out_ptr=out,
        stride_x_token=x.stride(0),
        stride_out_token=out.stride(0),
        INTERMEDIATE=intermediate,
        BLOCK=block,
        num_warps=4,
    )
    return out
