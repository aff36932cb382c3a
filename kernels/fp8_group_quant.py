"""Per-token-group FP8 (E4M3) quantization of activations: the input of the W8A8 block GEMM.

    g = k // group_size                       (a group: `group_size` columns of one row)
    scale[t, g] = max(amax(|x[t, group g]|) / 448, 1 / (448 * 512))
    q[t, k]     = round_to_e4m3(clamp(x[t, k] / scale[t, g], -448, 448))

DeepSeek-V3's activation format for its block-scaled weights (1 x 128 groups, fp32 scales):
a scale per token per block column, so an outlier spends its range on its own 128 columns
only, not the row's. The group is the weight block's columns, so a K step of the GEMM
(kernels/fp8_block_w8a8.py) lies in one activation group and one weight scale column; the
last group of a K that is not a multiple is ragged (its amax is over the columns it has).

The rounding is kernels/fp8_quant.py's (`round_to_e4m3`, IEEE divisions): q is torch's own
`.to(float8_e4m3fn)` of x / scale bit for bit, and scale the torch division's value
(`ref_quantize_per_token_group_fp8`), on every backend.

Layout: the scales are returned as an [M, num_groups] view of a [num_groups, M] buffer
(column-major, as DeepGEMM and vLLM keep them): the GEMM reads one group's scales for
BLOCK_M consecutive rows per K step, a contiguous load.

Grid (cdiv(M, ROWS), num_groups): a program quantizes one group of ROWS rows as one
[ROWS, GROUP_P2] tile (GROUP_P2 the group size's power of two, the extra lanes masked;
ROWS x GROUP_P2 about `TILE_VALUES`), reading each value once and storing ROWS consecutive
scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_dtype, check_last_dim_contiguous, check_ndim, check_same_device
from kernels.fp8_quant import FP8_DTYPE, FP8_MAX, MIN_SCALE, round_to_e4m3

TILE_VALUES = 2048  # values per program (ROWS x GROUP_P2), at most


@triton.jit(do_not_specialize=["M"])
def _quantize_groups_kernel(
    x_ptr,  # [M, K] bf16 / fp16 / fp32, rows stride_x apart
    q_ptr,  # [M, K] float8_e4m3fn, rows stride_q apart
    s_ptr,  # fp32 [M, num_groups]: column-major, group g's scales at s_ptr + g * stride_sg
    M,
    K,
    group_size,  # int: columns per group
    stride_x,
    stride_q,
    stride_sg,
    ROWS: tl.constexpr,  # int: rows per program, a power of two
    GROUP_P2: tl.constexpr,  # int: next_power_of_2(group_size)
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    group = tl.program_id(1)
    lanes = tl.arange(0, GROUP_P2)  # [GROUP_P2]
    cols = group * group_size + lanes
    mask_m = rows < M
    mask = mask_m[:, None] & ((lanes < group_size) & (cols < K))[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)  # [ROWS, GROUP_P2]
    amax = tl.max(tl.abs(x), axis=1)  # [ROWS]
    # IEEE divisions (div_rn), as kernels/fp8_quant.py: torch's values bit for bit.
    scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1.0 / (448.0 * 512.0))
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -448.0), 448.0)
    q = round_to_e4m3(v)
    q_ptrs = q_ptr + rows64[:, None] * stride_q + cols[None, :]
    tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + group.to(tl.int64) * stride_sg + rows, scale, mask=mask_m)


def num_groups(k: int, group_size: int) -> int:
    return -(-k // group_size)


def quantize_per_token_group_fp8(
    x: torch.Tensor,  # [M, K], contiguous in its last dimension
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fp8 [M, K], fp32 [M, ceil(K / group_size)]
    """x quantized per token and `group_size` columns (see the module doc); the scales an
    [M, groups] view with strides (1, M)."""
    check_ndim("x", x, 2, "[M, K]")
    check_dtype("x", x, (torch.float32, torch.float16, torch.bfloat16))
    check_last_dim_contiguous("x", x)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}.")
    m, k = x.shape
    groups = num_groups(k, group_size)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(groups, m, dtype=torch.float32, device=x.device).T  # [M, groups]
    check_same_device(x=x, q=q, scale=scale)
    if m == 0 or k == 0:
        return q, scale
    group_p2 = triton.next_power_of_2(group_size)
    rows = max(1, min(triton.next_power_of_2(m), TILE_VALUES // group_p2))
    _quantize_groups_kernel[(triton.cdiv(m, rows), groups)](
        x_ptr=x, q_ptr=q, s_ptr=scale, M=m, K=k, group_size=group_size,
        stride_x=x.stride(0), stride_q=q.stride(0), stride_sg=scale.stride(1),
        ROWS=rows, GROUP_P2=group_p2,
    )  # fmt: skip
    return q, scale


def ref_quantize_per_token_group_fp8(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:  # fp8 [M, K], fp32 [M, groups]
    """The pure-torch reference (the same formula, torch's own FP8 cast)."""
    m, k = x.shape
    groups = num_groups(k, group_size)
    padded = torch.zeros(m, groups * group_size, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    blocks = padded.view(m, groups, group_size)
    scale = (blocks.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)  # [M, groups]
    q = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, -1)[:, :k]
    return q.to(FP8_DTYPE), scale


def dequantize_groups_float64(q: torch.Tensor, scale: torch.Tensor, group_size: int):
    """q * scale per group in float64: [M, K] (the activations the W8A8 GEMM multiplies)."""
    k = q.shape[1]
    return q.double() * scale.double().repeat_interleave(group_size, 1)[:, :k]
