"""Wrapper of the grouped GEMM of the native MoE path (moe_kernels.c)."""

from __future__ import annotations

import torch

from engine.native.build import load_library


def moe_grouped_gemm(
    x: torch.Tensor,  # [num_x_rows, k] fp32, rows may be strided
    rows: torch.Tensor | None,  # [M] int64: the x row of each output row; None: row i is x[i]
    weight: torch.Tensor,  # [num_experts, n, k] fp32 contiguous
    offsets: torch.Tensor,  # [num_experts + 1] int64 CPU: expert e owns rows offsets[e]..[e+1]
) -> torch.Tensor:  # [M, n]
    """out[i] = x[rows[i]] @ weight[e].T for each expert e's rows, one native call."""
    num_experts, n, k = weight.shape
    num_rows = int(offsets[-1]) if offsets.numel() else 0
    problems = []
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        problems.append(f"dtypes {x.dtype}/{weight.dtype} (need float32)")
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        problems.append(f"x {tuple(x.shape)} strides {x.stride()} for k={k}")
    if not weight.is_contiguous():
        problems.append("weight not contiguous")
    if offsets.dtype != torch.int64 or offsets.numel() != num_experts + 1:
        problems.append(f"offsets {offsets.dtype} of {offsets.numel()} for {num_experts} experts")
    if rows is not None and (rows.dtype != torch.int64 or not rows.is_contiguous()):
        problems.append("rows not a contiguous int64 vector")
    elif rows is not None and rows.numel() < num_rows:
        problems.append(f"{rows.numel()} rows for {num_rows} outputs")
    elif rows is None and x.shape[0] < num_rows:
        problems.append(f"x has {x.shape[0]} rows for {num_rows} outputs")
    if problems:
        raise ValueError("moe_grouped_gemm: " + "; ".join(problems))
    out = x.new_empty(num_rows, n)
    if num_rows == 0:
        return out
    offsets = offsets.contiguous()
    load_library().moe_grouped_gemm_f32(
        out.data_ptr(),
        x.data_ptr(),
        x.stride(0),
        None if rows is None else rows.data_ptr(),
        weight.data_ptr(),
        offsets.data_ptr(),
        num_experts,
        n,
        k,
        torch.get_num_threads(),
    )
    return out
