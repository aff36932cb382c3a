"""Block-scaled FP8 (E4M3) weights times 16-bit (or fp32) activations: a W8A16 GEMM.

    out[m, n] = sum_k x[m, k] * W[n, k] * S[n // BN, k // BK]
        W fp8 [N, K], S fp32 [ceil(N / BN), ceil(K / BK)]  (BN, BK) = block_size

The weight layout of transformers' block-scaled FP8 (Qwen3-*-FP8, DeepSeek-V3: blocks of
128 x 128) and compressed-tensors' FP8_BLOCK, ragged edge blocks included. A decode step
reads every weight once, so keeping it in FP8 halves the bytes it reads against the weights
dequantized at load. The activations are not quantized (no FP8 tensor cores needed: any
GPU Triton runs on)::

    grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))
    program (n, m): acc[BLOCK_M, BLOCK_N] fp32 = 0
        for each K step k0 (BLOCK_K divides BK, so the step lies inside one scale column):
            w = W[n tile, k0:k0+BLOCK_K] converted to x's dtype    (exact: E4M3 fits all three)
            s = S[rows of the n tile // BN, k0 // BK]              [BLOCK_N] fp32
            acc += tl.dot(x tile, w.T) * s[None, :]
        out = acc, cast to x's dtype

Why this design: a step never straddles a scale column (BLOCK_K, a power of two, divides
BK: 16..128 for the served 128; a block whose columns have no power-of-two divisor >= 16,
e.g. 40, is refused and its layers stay dequantized), while a tile's rows may span several
row blocks at no cost (the scales are gathered per row, once per step). The scale multiplies
the step's fp32 dot, not the weight: the FP8 value is exact in the 16-bit dtype, so the only
roundings are fp32 ones (the dot's accumulation, one multiply and one add per step) and the
output's, and an fp16 weight times a large scale cannot overflow. Decode rows run in 16-row
dot tiles (rows masked), the bandwidth-bound regime where the wasted MMA rows cost nothing.

Where K is a multiple of BLOCK_K (`EVEN_K`, every served shape) the loads carry no K mask
(vector loads on the GPU); other K are masked. `triton.autotune` picks BLOCK_N / BLOCK_K /
warps / stages on the GPU, keyed on the row bucket, N, K and BK; the interpreter cannot
time and takes the first config that fits (tests pass explicit `BlockGemmConfig`s).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import (
    check_contiguous,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    dot_precision,
    even_k,
    is_interpreter,
    launch_tuned,
)

FP8_DTYPE = torch.float8_e4m3fn
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_BLOCK_K = 16  # tl.dot's smallest K
MAX_BLOCK_K = 128


def row_bucket(m: int) -> int:
    """BLOCK_M for m rows: 16 (decode: tl.dot's smallest tile), 32, 64, or 128 (prefill)."""
    return min(max(16, triton.next_power_of_2(max(m, 1))), 128)


def max_block_k(block_cols: int) -> int:
    """The widest K step inside one scale column: the largest power of two dividing
    `block_cols`, at most 128 (0 when it is under tl.dot's 16: the kernel does not take it)."""
    step = block_cols & -block_cols  # the lowest set bit
    step = min(step, MAX_BLOCK_K)
    return step if step >= MIN_BLOCK_K else 0


def kernel_takes_block(block_size: tuple[int, int]) -> bool:
    """Whether the kernel runs weights with this [rows, cols] block (any rows; cols with a
    power-of-two divisor >= 16: 128, 64, 48, 32, ...)."""
    rows, cols = block_size
    return rows > 0 and cols > 0 and max_block_k(cols) > 0


@dataclass(frozen=True, slots=True)
class BlockGemmConfig:
    """One tile shape (what the autotuner chooses between); BLOCK_M comes from the rows."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def fits(self, bucket: int, block_cols: int) -> bool:
        """Its K step divides the scale column, and its accumulator fits the warps
        (64 x 128 fp32 for 4 warps, 128 x 128 for 8) without spilling."""
        step = max_block_k(block_cols)
        fits_step = step > 0 and step % self.block_k == 0
        return fits_step and bucket * self.block_n <= 2048 * self.num_warps

    def triton(self) -> triton.Config:
        kwargs = {"BLOCK_N": self.block_n, "BLOCK_K": self.block_k}
        return triton.Config(kwargs, num_warps=self.num_warps, num_stages=self.num_stages)


# The candidates (N, K and the block are run-time arguments: one binary per config and
# row bucket serves every shape). Narrow tiles give a decode step enough programs.
GPU_CONFIGS = (
    BlockGemmConfig(64, 128, 4, 3),
    BlockGemmConfig(32, 128, 4, 4),
    BlockGemmConfig(128, 128, 4, 3),
    BlockGemmConfig(64, 64, 4, 4),
    BlockGemmConfig(128, 128, 8, 3),
    BlockGemmConfig(128, 64, 8, 4),
    # narrow K steps: blocks whose columns are a multiple of 16 or 32 only (tests, odd blocks)
    BlockGemmConfig(32, 32, 4, 2),
    BlockGemmConfig(32, 16, 4, 2),
)


def candidate_configs(bucket: int, block_cols: int) -> list[BlockGemmConfig]:
    """The configs the autotuner times (the interpreter, which cannot time: the first):
    those that fit, with K steps of at least 64 where the block allows (the narrow ones
    are for blocks that allow no wider step)."""
    widest = min(64, max_block_k(block_cols))
    fitting = [c for c in GPU_CONFIGS if c.fits(bucket, block_cols) and c.block_k >= widest]
    return fitting[:1] if is_interpreter() else fitting


_TRITON_CONFIGS = {c: c.triton() for c in GPU_CONFIGS}


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    args = {**named_args, **kwargs}
    return [_TRITON_CONFIGS[c] for c in candidate_configs(args["BLOCK_M"], args["BLOCK_COLS"])]


@triton.jit(do_not_specialize=["M"])
def _fp8_block_gemm_kernel(
    x_ptr,  # [M, K] fp16 / bf16 / fp32, rows stride_x apart
    w_ptr,  # fp8 [N, K], contiguous
    s_ptr,  # fp32 [ceil(N / BLOCK_ROWS), ceil(K / BLOCK_COLS)], contiguous
    out_ptr,  # [M, N] in x's dtype
    M,
    N,
    K,
    BLOCK_ROWS,  # int: the scale block's rows (BN)
    BLOCK_COLS,  # int: the scale block's columns (BK), a multiple of BLOCK_K
    stride_x,
    stride_w,
    stride_s,
    stride_out,
    DOT_PRECISION: tl.constexpr,  # str | None
    BLOCK_M: tl.constexpr,  # int: 16, 32, 64 or 128 (`row_bucket`)
    BLOCK_N: tl.constexpr,  # int
    BLOCK_K: tl.constexpr,  # int, divides BLOCK_COLS
    EVEN_K: tl.constexpr,  # bool: K a multiple of BLOCK_K (no K mask)
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    w_rows = offs_n.to(tl.int64)
    s_rows = s_ptr + (offs_n // BLOCK_ROWS).to(tl.int64) * stride_s  # [BLOCK_N] pointers
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * stride_x + offs_k[None, :]
        w_ptrs = w_ptr + w_rows[:, None] * stride_w + offs_k[None, :]
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)  # [BLOCK_N, BLOCK_K] fp8
        else:
            mask_k = offs_k < K
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        s = tl.load(s_rows + k0 // BLOCK_COLS, mask=mask_n, other=0.0)  # [BLOCK_N] fp32
        part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
        acc += part * s[None, :]
    out = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


_CACHE_RESULTS = (
    {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters
    else {}
)  # fmt: skip


_fp8_block_gemm = triton.heuristics({"EVEN_K": even_k})(_fp8_block_gemm_kernel)
_fp8_block_gemm_autotuned = triton.autotune(
    configs=list(_TRITON_CONFIGS.values()),
    key=["BLOCK_M", "N", "K", "BLOCK_COLS"],
    prune_configs_by={"early_config_prune": _prune},
    **_CACHE_RESULTS,
)(_fp8_block_gemm)


def _check(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int]
) -> None:
    check_ndim("x", x, 2, "[M, K]")
    check_dtype("x", x, ACTIVATION_DTYPES)
    check_last_dim_contiguous("x", x)
    check_ndim("weight", weight, 2, "[N, K]")
    check_dtype("weight", weight, (FP8_DTYPE,))
    check_contiguous("weight", weight)
    check_dtype("weight_scale", scale, (torch.float32,))
    check_contiguous("weight_scale", scale)
    check_same_device(x=x, weight=weight, weight_scale=scale)
    if len(block_size) != 2 or not kernel_takes_block(tuple(block_size)):
        raise ValueError(
            f"block_size must be [rows, cols] with cols a multiple of {MIN_BLOCK_K} "
            f"(a K step inside one scale column), got {list(block_size)}."
        )
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weight K={k}.")
    grid = (triton.cdiv(n, block_size[0]), triton.cdiv(k, block_size[1]))
    if tuple(scale.shape) != grid:
        raise ValueError(
            f"weight_scale must be the block grid {list(grid)} of a [{n}, {k}] weight in "
            f"blocks {list(block_size)}, got shape {list(scale.shape)}."
        )


def fp8_block_gemm(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32
    weight: torch.Tensor,  # fp8 [N, K]
    weight_scale: torch.Tensor,  # fp32 [ceil(N / rows), ceil(K / cols)]
    block_size: tuple[int, int],  # (rows, cols)
    config: BlockGemmConfig | None = None,  # None: autotuned
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ (W * S per block).T with W dequantized in registers (see the module doc)."""
    _check(x, weight, weight_scale, block_size)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    bucket = row_bucket(m)
    rows, cols = int(block_size[0]), int(block_size[1])
    if config is not None and not config.fits(bucket, cols):
        raise ValueError(f"config {config} does not fit {m} rows in blocks of {cols} columns.")
    args = {
        "x_ptr": x, "w_ptr": weight, "s_ptr": weight_scale, "out_ptr": out, "M": m, "N": n,
        "K": k, "BLOCK_ROWS": rows, "BLOCK_COLS": cols, "stride_x": x.stride(0),
        "stride_w": weight.stride(0), "stride_s": weight_scale.stride(0),
        "stride_out": out.stride(0), "DOT_PRECISION": dot_precision(x.dtype), "BLOCK_M": bucket,
    }  # fmt: skip

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, bucket)

    launch_tuned(_fp8_block_gemm_autotuned, _fp8_block_gemm, grid, args, config)
    return out


def ref_fp8_block_gemm(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_size: tuple[int, int]
) -> torch.Tensor:  # float64 [M, N]
    """The float64 product of x and the block-dequantized weight (the kernel's exact value)."""
    n, k = weight.shape
    rows, cols = block_size
    spread = weight_scale.double().repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)
    return x.double() @ (weight.double() * spread[:, :k]).T
