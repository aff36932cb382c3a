"""FP8 (E4M3) weights times 16-bit activations for few rows: the decode-step GEMV (W8A16).

    out[m, n] = s_w[n] * sum_k x[m, k] * float(W[n, k])      W fp8 [N, K], s_w fp32 [N] or [1]

A decode step multiplies a handful of rows by every weight once, so it is bound by reading
the weights: one byte each in FP8. `torch._scaled_mm` (engine/layers/fp8_linear.py) first
quantizes the rows in a kernel of their own, pads M to 16 and runs cuBLASLt's FP8 GEMM, whose
tiles are sized for many rows. Here each program streams a [BLOCK_N, BLOCK_K] slab of the
weight, converts it to fp32 (or to the activations' dtype for `tl.dot`) in registers, and
accumulates in fp32; the scale multiplies each output once at the end::

    grid (cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, rows per program))
    program (n, s, m):  rows m*BM .. , outputs n*BLOCK_N .., K range s of SPLIT_K
        one row (M == 1, DOT off):  acc[BLOCK_N] += sum_k W[n, k] * x[k]   (FMAs, no padding)
        else (DOT):                 acc[BM, BLOCK_N] = tl.dot(x, W.T, acc) (BM >= 16, masked)
    SPLIT_K == 1: out = acc * s_w, cast;   SPLIT_K > 1: partial sums into an fp32 workspace
    [SPLIT_K, M, N], then `_sum_splits_kernel` adds them in split order (deterministic: no
    atomics) and casts.

Where K is a multiple of BLOCK_K * SPLIT_K (`EVEN_K`, a heuristic per config: every served
shape) the loads carry no K mask: a mask on a run-time bound made the sm_90 code load the
weight byte by byte, without it the FMA path loads 16 bytes at a time and the dot path
pipelines 16-byte `cp.async` copies. Other K take the masked loads (tests, odd shapes).

The activations are not quantized: this is W8A16, the product of the stored FP8 weight
(exact in fp32, bf16 and fp16) with the unrounded activations. The FP8 path's error bound
(tests/engine/layers/test_fp8_linear.py: the activations' FP8 rounding, per token) holds a
fortiori: only the fp32 accumulation and the output's rounding are left. A checkpoint's
static `input_scale` is not used either way (the layer already quantizes per token with a
scale that is never coarser; see engine/layers/fp8_linear.py), so a static-scale checkpoint's
rows land within the same bound. Rows that switch between this kernel and `_scaled_mm` (the
layer's crossover, engine/layers/crossover.py) differ by that activation rounding, not more.

`triton.autotune` picks BLOCK_N / BLOCK_K / SPLIT_K / DOT / warps on the GPU, keyed on the
row bucket (1, <=16, <=32, more), N and K: which tiles stream the weight fastest depends on
the GPU, so it is measured there. The interpreter cannot time kernels: it takes the first
config that fits (tests pass explicit `Fp8GemvConfig`s to cover the others).
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
    is_interpreter,
    launch_tuned,
)

FP8_DTYPE = torch.float8_e4m3fn
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DOT_MIN_ROWS = 16  # tl.dot's smallest tile height
# A split must keep at least this many BLOCK_K steps (shorter ones cost more than they save).
_MIN_STEPS_PER_SPLIT = 4


def row_bucket(m: int) -> int:
    """Rows per program of the DOT tiles (1: the one-row FMA path may run): 1, 16, 32, 64."""
    if m <= 1:
        return 1
    return min(max(DOT_MIN_ROWS, triton.next_power_of_2(m)), 64)


@dataclass(frozen=True, slots=True)
class Fp8GemvConfig:
    """One tile shape of the kernel (what the autotuner chooses between)."""

    block_n: int
    block_k: int
    split_k: int = 1
    dot: bool = True  # False: the one-row FMA path (M == 1 only)
    num_warps: int = 4
    num_stages: int = 3

    def triton(self) -> triton.Config:
        kwargs = {
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "SPLIT_K": self.split_k,
            "DOT": self.dot,
        }
        return triton.Config(kwargs, num_warps=self.num_warps, num_stages=self.num_stages)


# The candidates. N and K are run-time arguments (every 8B shape shares one binary per
# config), so the first start compiles each config once: ~21 compiles per dtype.
GPU_CONFIGS = (
    # one row: FMAs over wide K slabs (8-16 KB of weight in flight per program and step),
    # one split over K (a long down_proj row)
    Fp8GemvConfig(16, 512, 1, False, 4),
    Fp8GemvConfig(32, 256, 1, False, 4),
    Fp8GemvConfig(16, 1024, 1, False, 8),
    Fp8GemvConfig(32, 512, 1, False, 8),
    Fp8GemvConfig(64, 256, 1, False, 8),
    Fp8GemvConfig(16, 512, 2, False, 4),
    # tensor-core tiles (any row count; masked rows below 16)
    Fp8GemvConfig(32, 128, 1, True, 4, 4),
    Fp8GemvConfig(64, 128, 1, True, 4, 3),
    Fp8GemvConfig(64, 256, 1, True, 8, 3),
    Fp8GemvConfig(128, 128, 1, True, 8, 3),
    Fp8GemvConfig(32, 128, 2, True, 4, 4),
)


def config_fits(config: Fp8GemvConfig, bucket: int) -> bool:
    """Whether a config can run a row bucket at all: FMAs take one row only."""
    return config.dot or bucket == 1


def candidate_configs(bucket: int, k: int) -> list[Fp8GemvConfig]:
    """The configs the autotuner times for this bucket and K (the interpreter, which cannot
    time: the first). A split over K only at <= 16 rows (more rows amortise the weight
    read already) and where each split keeps `_MIN_STEPS_PER_SPLIT` BLOCK_K steps."""

    def worth_it(c: Fp8GemvConfig) -> bool:
        if c.split_k == 1:
            return True
        steps = triton.cdiv(k, c.block_k)
        return bucket <= DOT_MIN_ROWS and steps >= c.split_k * _MIN_STEPS_PER_SPLIT

    fitting = [c for c in GPU_CONFIGS if config_fits(c, bucket) and worth_it(c)]
    return fitting[:1] if is_interpreter() else fitting


_TRITON_CONFIGS = {c: c.triton() for c in GPU_CONFIGS}  # the autotuner's own Config objects


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The autotuner's `early_config_prune`: `candidate_configs` of this call."""
    args = {**named_args, **kwargs}
    return [_TRITON_CONFIGS[c] for c in candidate_configs(args["M_BUCKET"], args["K"])]


@triton.jit
def _dot_rows(
    x_ptr, w_ptr, offs_n, mask_n, pid_m, k_lo, k_hi, M, stride_x, stride_w,
    BLOCK_M: tl.constexpr,  # int, >= 16
    BLOCK_N: tl.constexpr,  # int
    BLOCK_K: tl.constexpr,  # int
    EVEN_K: tl.constexpr,  # bool: every step a whole BLOCK_K (no K mask)
    DOT_PRECISION: tl.constexpr,  # str | None
):  # fmt: skip
    """[BLOCK_M, BLOCK_N] fp32 sums over k in [k_lo, k_hi) of x[m, k] * W[n, k]."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    rows = offs_m.to(tl.int64)
    w_rows = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * stride_x + offs_k[None, :]
        w_ptrs = w_ptr + w_rows[:, None] * stride_w + offs_k[None, :]
        if EVEN_K:  # no K mask: 16-byte loads
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)  # [BLOCK_N, BLOCK_K] fp8
        else:
            mask_k = offs_k < k_hi
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        w = w.to(x.dtype)  # FP8 values are exact in bf16 / fp16 / fp32
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _fma_row(
    x_ptr, w_ptr, offs_n, mask_n, k_lo, k_hi, stride_w,
    BLOCK_N: tl.constexpr,  # int
    BLOCK_K: tl.constexpr,  # int
    EVEN_K: tl.constexpr,  # bool: every step a whole BLOCK_K (no K mask)
):  # fmt: skip
    """[1, BLOCK_N] fp32 sums over k in [k_lo, k_hi) of x[0, k] * W[n, k] (one row)."""
    w_rows = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + w_rows[:, None] * stride_w + offs_k[None, :]
        if EVEN_K:  # no K mask: 16-byte loads
            x = tl.load(x_ptr + offs_k)  # [BLOCK_K]
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)  # [BLOCK_N, BLOCK_K] fp8
        else:
            mask_k = offs_k < k_hi
            x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = x.to(tl.float32)
        w = w.to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    return acc[None, :]


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(
    x_ptr,  # [M, K] fp16 / bf16 / fp32
    w_ptr,  # fp8 [N, K]
    scale_ptr,  # fp32 [N] (PER_CHANNEL) or [1]
    out_ptr,  # [M, N] in x's dtype (SPLIT_K == 1)
    partial_ptr,  # fp32 [SPLIT_K, M, N] (SPLIT_K > 1)
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    M_BUCKET: tl.constexpr,  # int: 1, 16, 32 or 64 (`row_bucket`)
    PER_CHANNEL: tl.constexpr,  # bool
    DOT_PRECISION: tl.constexpr,  # str | None
    BLOCK_N: tl.constexpr,  # int
    BLOCK_K: tl.constexpr,  # int
    SPLIT_K: tl.constexpr,  # int
    DOT: tl.constexpr,  # bool
    EVEN_K: tl.constexpr,  # bool: K a multiple of BLOCK_K * SPLIT_K (`_even_k`)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if DOT:
        if M_BUCKET == 1:
            acc = _dot_rows(x_ptr, w_ptr, offs_n, mask_n, pid_m, k_lo, k_hi, M, stride_x,
                            stride_w, 16, BLOCK_N, BLOCK_K, EVEN_K,
                            DOT_PRECISION)  # fmt: skip
            offs_m = pid_m * 16 + tl.arange(0, 16)
        else:
            acc = _dot_rows(x_ptr, w_ptr, offs_n, mask_n, pid_m, k_lo, k_hi, M, stride_x,
                            stride_w, M_BUCKET, BLOCK_N, BLOCK_K, EVEN_K,
                            DOT_PRECISION)  # fmt: skip
            offs_m = pid_m * M_BUCKET + tl.arange(0, M_BUCKET)
    else:
        acc = _fma_row(x_ptr, w_ptr, offs_n, mask_n, k_lo, k_hi, stride_w, BLOCK_N, BLOCK_K, EVEN_K)
        offs_m = pid_m + tl.arange(0, 1)
    if PER_CHANNEL:
        scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
    else:
        scale = tl.load(scale_ptr + offs_n * 0)
    acc = acc * scale[None, :]
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    if SPLIT_K == 1:
        out = out_ptr + rows * stride_out + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        partial = partial_ptr + (pid_k * M + rows) * N + offs_n[None, :]
        tl.store(partial, acc, mask=mask)


# Later starts read the timings from Triton's cache (where this Triton can keep them).
_CACHE_RESULTS = (
    {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters
    else {}
)  # fmt: skip


def _even_k(args: dict) -> bool:
    """Whether every K step is whole: then the weight loads carry no K mask, which is what
    lets them be 16-byte vector loads (a mask on a run-time bound makes them byte loads)."""
    return args["K"] % (args["BLOCK_K"] * args["SPLIT_K"]) == 0


_fp8_gemv = triton.heuristics({"EVEN_K": _even_k})(_fp8_gemv_kernel)
_fp8_gemv_autotuned = triton.autotune(
    configs=list(_TRITON_CONFIGS.values()),
    key=["M_BUCKET", "N", "K"],
    prune_configs_by={"early_config_prune": _prune},
    **_CACHE_RESULTS,
)(_fp8_gemv)


@triton.jit
def _sum_splits_kernel(
    partial_ptr,  # fp32 [SPLIT_K, M * N]
    out_ptr,  # [M * N], contiguous
    MN,
    SPLIT_K: tl.constexpr,  # int
    BLOCK: tl.constexpr,  # int
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    total = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):  # always this order: the same bits on every run
        total += tl.load(partial_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """Validates the operands; True for per-channel scales ([N]), False for per-tensor."""
    check_ndim("x", x, 2, "[M, K]")
    check_dtype("x", x, ACTIVATION_DTYPES)
    check_last_dim_contiguous("x", x)
    check_ndim("weight", weight, 2, "[N, K]")
    check_dtype("weight", weight, (FP8_DTYPE,))
    check_contiguous("weight", weight)
    check_dtype("weight_scale", weight_scale, (torch.float32,))
    check_contiguous("weight_scale", weight_scale)
    check_same_device(x=x, weight=weight, weight_scale=weight_scale)
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weight K={k}.")
    if weight_scale.numel() not in (1, n):
        raise ValueError(
            f"weight_scale must have 1 (per tensor) or N={n} (per channel) values, "
            f"got shape {tuple(weight_scale.shape)}."
        )
    return weight_scale.numel() == n and n != 1


def fp8_gemv(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32
    weight: torch.Tensor,  # fp8 [N, K] (the checkpoint's layout)
    weight_scale: torch.Tensor,  # fp32 [N] or [1] / []
    config: Fp8GemvConfig | None = None,  # None: autotuned
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ (W * s_w).T with W dequantized in registers (see the module doc)."""
    per_channel = _check(x, weight, weight_scale)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    bucket = row_bucket(m)
    if config is not None and not config_fits(config, bucket):
        raise ValueError(f"config {config} takes one row (dot=False), got {m} rows.")
    configs = [config] if config is not None else candidate_configs(bucket, k)
    max_split = max(c.split_k for c in configs)
    partial = torch.empty((max_split, m, n) if max_split > 1 else (1,), device=x.device,
                          dtype=torch.float32)  # fmt: skip

    def grid(meta: dict) -> tuple[int, int, int]:
        rows = 1 if not meta["DOT"] else max(bucket, DOT_MIN_ROWS)
        return triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"], triton.cdiv(m, rows)

    args = {
        "x_ptr": x, "w_ptr": weight, "scale_ptr": weight_scale, "out_ptr": out,
        "partial_ptr": partial, "M": m, "N": n, "K": k, "stride_x": x.stride(0),
        "stride_w": weight.stride(0), "stride_out": out.stride(0), "M_BUCKET": bucket,
        "PER_CHANNEL": per_channel,
        "DOT_PRECISION": dot_precision(x.dtype),
    }  # fmt: skip
    split = launch_tuned(_fp8_gemv_autotuned, _fp8_gemv, grid, args, config).kwargs["SPLIT_K"]
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            partial_ptr=partial, out_ptr=out, MN=m * n, SPLIT_K=split, BLOCK=block
        )
    return out


def ref_fp8_gemv(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:  # float64 [M, N]
    """The float64 product of x and the dequantized weight (the kernel's exact value)."""
    scale = weight_scale.double().reshape(-1)
    w = weight.double() * (scale[:, None] if scale.numel() > 1 else scale)
    return x.double() @ w.T
