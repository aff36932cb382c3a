"""Block-scaled FP8 weights times per-token-group FP8 activations on FP8 tensor cores: W8A8.

    out[m, n] = sum_g A_s[m, g] * S[n // BN, g] * sum_{k in column block g} A[m, k] * W[n, k]
        A fp8 [M, K], A_s fp32 [M, ceil(K / BK)]   (kernels/fp8_group_quant.py, groups of BK)
        W fp8 [N, K], S fp32 [ceil(N / BN), ceil(K / BK)]   (BN, BK) = block_size

The prefill route of a block-scaled FP8 projection (engine/layers/fp8_block_linear.py) on
GPUs with FP8 tensor cores (sm_89+): the W8A16 GEMM (kernels/fp8_block_gemm.py) runs on
16-bit tensor cores after converting each weight tile, while here both operands are E4M3
and `tl.dot` runs on the FP8 ones, twice the 16-bit peak on Hopper. DeepSeek-V3's recipe::

    grid: cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) programs, GROUP_M row tiles side by side
    program (m, n): acc[BLOCK_M, BLOCK_N] fp32 = 0
        for each K step k0 (BLOCK_K divides BK: the step lies in one scale column g):
            part = tl.dot(A[m tile, step], W[n tile, step].T)       fp8 x fp8 -> fp32
            acc += part * A_s[m rows, g][:, None] * S[n rows // BN, g][None, :]
        out = acc, cast to the activations' dtype

Why the scales multiply each step's partial: Hopper's FP8 MMA accumulates in fewer bits than
fp32 (DeepSeek-V3's report: about 14), so a K of thousands accumulated inside the tensor
core loses digits; a step of at most 128 products is promoted to the fp32 accumulator in
registers, which is their remedy, and the scales, constant over the step, ride along.

K steps: `tl.dot` on 8-bit operands needs K >= 32, so blocks whose columns have no
power-of-two divisor of at least 32 are refused (`w8a8_takes_block`: such layers keep the
W8A16 route at every row count). Ragged edges (N, K not multiples of the block or the tile)
are masked; where K is a multiple of BLOCK_K (`EVEN_K`) the loads carry no K mask.

GROUP_M: programs that run together share W tiles across GROUP_M row tiles, so a
prefill's weight is read from DRAM about once per GROUP_M row tiles rather than once per
row tile (the usual L2 swizzle).

`triton.autotune` picks the tile on the GPU, keyed on the row bucket (16 .. 256), N, K and
BK; the interpreter cannot time and takes the first config that fits (tests pass explicit
`W8A8Config`s). The interpreter runs fp8 x fp8 `tl.dot` (exactly: products of E4M3 values
are exact in fp32), so the tests run this very kernel on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import (
    check_contiguous,
    check_dtype,
    check_ndim,
    check_same_device,
    even_k,
    is_interpreter,
    launch_tuned,
)
from kernels.fp8_block_gemm import _CACHE_RESULTS, FP8_DTYPE, max_block_k
from kernels.fp8_group_quant import quantize_per_token_group_fp8

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_FP8_BLOCK_K = 32  # tl.dot's smallest K on 8-bit operands (NVIDIA)


def w8a8_block_k(block_cols: int) -> int:
    """The widest K step inside one scale column for FP8 operands (0: none of >= 32)."""
    step = max_block_k(block_cols)
    return step if step >= MIN_FP8_BLOCK_K else 0


def w8a8_takes_block(block_size: tuple[int, int]) -> bool:
    """Whether this kernel runs weights with this [rows, cols] block (cols a multiple of 32:
    128, 64, 96, 32, ...)."""
    rows, cols = block_size
    return rows > 0 and cols > 0 and w8a8_block_k(cols) > 0


def m_bucket(m: int) -> int:
    """The autotune key of m rows: 16 .. 256 by powers of two (tiles of up to 128 rows)."""
    return min(max(16, triton.next_power_of_2(max(m, 1))), 256)


@dataclass(frozen=True, slots=True)
class W8A8Config:
    """One tile shape; BLOCK_M is min(block_m, the rows' bucket)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    ragged_k: bool = True  # whether it takes a K that is not a multiple of its step

    def tile_m(self, bucket: int) -> int:
        return min(self.block_m, bucket)

    def fits(self, bucket: int, block_cols: int, even_k: bool = True) -> bool:
        """Its K step divides the scale column (>= 32), its fp32 accumulator fits the warps
        (64 x 128 for 4 warps, 128 x 128 for 8) without spilling, and it takes a K tail
        where there is one."""
        step = w8a8_block_k(block_cols)
        fits_step = step > 0 and step % self.block_k == 0 and (even_k or self.ragged_k)
        return fits_step and self.tile_m(bucket) * self.block_n <= 2048 * self.num_warps

    def triton(self) -> triton.Config:
        kwargs = {"BLOCK_N": self.block_n, "BLOCK_K": self.block_k, "GROUP_M": self.group_m}
        return triton.Config(kwargs, num_warps=self.num_warps, num_stages=self.num_stages)


# The candidates (BLOCK_M is a launch argument from the config and the row bucket).
# The widest 4-warp tile spills 8 bytes with a K tail's masks (sm_90): not for ragged K.
GPU_CONFIGS = (
    W8A8Config(64, 128, 128, 4, 3, ragged_k=False),
    W8A8Config(128, 128, 128, 8, 3),
    W8A8Config(128, 64, 128, 4, 4),
    W8A8Config(64, 64, 128, 4, 4),
    W8A8Config(128, 128, 64, 8, 4),
    W8A8Config(64, 128, 64, 4, 4),
    W8A8Config(32, 64, 128, 4, 4),  # few rows (what the crossover times at 16 .. 64 rows)
    W8A8Config(32, 32, 32, 4, 2),  # blocks of 32 or 96 columns
)


def candidate_configs(bucket: int, block_cols: int, k: int | None = None) -> list[W8A8Config]:
    """The configs the autotuner times (the interpreter, which cannot time: the first):
    those that fit (K: None, or a multiple of every step, is even), with K steps of at
    least 64 where the block allows."""
    widest = min(64, w8a8_block_k(block_cols))
    fitting = [
        c for c in GPU_CONFIGS
        if c.fits(bucket, block_cols, k is None or k % c.block_k == 0) and c.block_k >= widest
    ]  # fmt: skip
    return fitting[:1] if is_interpreter() else fitting


_TRITON_CONFIGS: dict[tuple[W8A8Config, int], triton.Config] = {}
for _config in GPU_CONFIGS:
    for _bucket in sorted({_config.tile_m(b) for b in (16, 32, 64, 128, 256)}):
        _tc = _config.triton()
        _tc.kwargs["BLOCK_M"] = _bucket
        _TRITON_CONFIGS[(_config, _bucket)] = _tc


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    args = {**named_args, **kwargs}
    bucket = args["M_BUCKET"]
    return [
        _TRITON_CONFIGS[(c, c.tile_m(bucket))]
        for c in candidate_configs(bucket, args["BLOCK_COLS"], args["K"])
    ]


@triton.jit
def w8a8_k_loop(
    a_ptrs,  # [BLOCK_M, BLOCK_K] pointers to the tile's first K step of FP8 activations
    w_ptrs,  # [BLOCK_N, BLOCK_K] pointers to the same of the FP8 weight rows
    as_rows,  # [BLOCK_M] pointers to each row's group scales (stride_as_g apart)
    s_rows,  # [BLOCK_N] pointers to each weight row's block-scale row (contiguous groups)
    stride_as_g,
    mask_m,
    mask_n,
    K,
    BLOCK_COLS,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """The K loop both W8A8 GEMMs run (dense and experts): per step an FP8 x FP8 dot in
    fp32, times the activation group's and the weight block's scales (a step never
    straddles a scale column). Returns the fp32 [BLOCK_M, BLOCK_N] accumulator."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)  # [BLOCK_M, BLOCK_K] fp8
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)  # [BLOCK_N, BLOCK_K] fp8
        else:
            mask_k = k0 + tl.arange(0, BLOCK_K) < K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        g = k0 // BLOCK_COLS
        a_s = tl.load(as_rows + g * stride_as_g, mask=mask_m, other=0.0)  # [BLOCK_M] fp32
        w_s = tl.load(s_rows + g, mask=mask_n, other=0.0)  # [BLOCK_N] fp32
        part = tl.dot(a, tl.trans(w))  # fp32
        acc += part * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit(do_not_specialize=["M"])
def _fp8_block_w8a8_kernel(
    a_ptr,  # fp8 [M, K], rows stride_a apart
    as_ptr,  # fp32 [M, ceil(K / BLOCK_COLS)], strides (stride_as_m, stride_as_g)
    w_ptr,  # fp8 [N, K], rows stride_w apart
    s_ptr,  # fp32 [ceil(N / BLOCK_ROWS), ceil(K / BLOCK_COLS)], contiguous
    out_ptr,  # [M, N], rows stride_out apart
    M,
    N,
    K,
    BLOCK_ROWS,  # int: the scale block's rows (BN)
    BLOCK_COLS,  # int: the scale block's columns (BK), a multiple of BLOCK_K
    stride_a,  # the row strides: separate from K, so that the JIT sees them aligned
    stride_w,
    stride_as_m,
    stride_as_g,
    stride_s,
    stride_out,
    M_BUCKET,  # int: the autotune key (`m_bucket`), unused in the body
    BLOCK_M: tl.constexpr,  # int
    BLOCK_N: tl.constexpr,  # int
    BLOCK_K: tl.constexpr,  # int, divides BLOCK_COLS, >= 32
    GROUP_M: tl.constexpr,  # int: row tiles per swizzle group
    EVEN_K: tl.constexpr,  # bool: K a multiple of BLOCK_K (no K mask)
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    w_rows = offs_n.to(tl.int64)
    as_rows = as_ptr + rows * stride_as_m  # [BLOCK_M] pointers
    s_rows = s_ptr + (offs_n // BLOCK_ROWS).to(tl.int64) * stride_s  # [BLOCK_N] pointers
    a_ptrs = a_ptr + rows[:, None] * stride_a + tl.arange(0, BLOCK_K)[None, :]
    w_ptrs = w_ptr + w_rows[:, None] * stride_w + tl.arange(0, BLOCK_K)[None, :]
    acc = w8a8_k_loop(
        a_ptrs, w_ptrs, as_rows, s_rows, stride_as_g, mask_m, mask_n, K, BLOCK_COLS,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
    )  # fmt: skip
    out = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


_fp8_block_w8a8 = triton.heuristics({"EVEN_K": even_k})(_fp8_block_w8a8_kernel)
_fp8_block_w8a8_autotuned = triton.autotune(
    configs=list(_TRITON_CONFIGS.values()),
    key=["M_BUCKET", "N", "K", "BLOCK_COLS"],
    prune_configs_by={"early_config_prune": _prune},
    **_CACHE_RESULTS,
)(_fp8_block_w8a8)


def check_w8a8_operands(a, a_scale, weight, scale, block_size, rows: str = "M") -> None:
    """The W8A8 GEMMs' operands (this one's weight [N, K], the experts' [E, N, K]): FP8
    activations [rows, K] with their per-group fp32 scales, FP8 weights with their block
    grids, a block whose columns an FP8 K step fits in; each refused naming it."""
    experts = weight.dim() == 3
    check_ndim("a", a, 2, f"[{rows}, K]")
    check_dtype("a", a, (FP8_DTYPE,))
    check_contiguous("a", a)
    check_ndim("a_scale", a_scale, 2, f"[{rows}, groups]")
    check_dtype("a_scale", a_scale, (torch.float32,))
    check_ndim(
        "weight", weight, 3 if experts else 2, "[num_experts, N, K]" if experts else "[N, K]"
    )
    check_dtype("weight", weight, (FP8_DTYPE,))
    check_contiguous("weight", weight)
    check_dtype("weight_scale", scale, (torch.float32,))
    check_contiguous("weight_scale", scale)
    check_same_device(a=a, a_scale=a_scale, weight=weight, weight_scale=scale)
    if block_size is None or len(block_size) != 2 or not w8a8_takes_block(tuple(block_size)):
        raise ValueError(
            f"block_size must be [rows, cols] with cols a multiple of {MIN_FP8_BLOCK_K} "
            f"(an FP8 K step inside one scale column), got "
            f"{None if block_size is None else list(block_size)}."
        )
    *lead, n, k = weight.shape
    if a.shape[1] != k:
        raise ValueError(f"a has {a.shape[1]} columns, the weight K={k}.")
    groups = -(-k // block_size[1])
    if tuple(a_scale.shape) != (a.shape[0], groups):
        raise ValueError(
            f"a_scale must be [{rows}, groups] = {[a.shape[0], groups]} (groups of "
            f"{block_size[1]} columns), got shape {list(a_scale.shape)}."
        )
    grid = (*lead, -(-n // block_size[0]), groups)
    if tuple(scale.shape) != grid:
        what = (
            f"block grids {list(grid)} of {[*lead, n, k]} weights"
            if experts
            else (f"block grid {list(grid)} of a [{n}, {k}] weight")
        )
        raise ValueError(
            f"weight_scale must be the {what} in blocks {list(block_size)}, "
            f"got shape {list(scale.shape)}."
        )


def fp8_block_w8a8_quantized(
    a: torch.Tensor,  # fp8 [M, K]
    a_scale: torch.Tensor,  # fp32 [M, ceil(K / cols)], any strides
    weight: torch.Tensor,  # fp8 [N, K]
    weight_scale: torch.Tensor,  # fp32 [ceil(N / rows), ceil(K / cols)]
    block_size: tuple[int, int],  # (rows, cols)
    out_dtype: torch.dtype,
    config: W8A8Config | None = None,  # None: autotuned
) -> torch.Tensor:  # [M, N] in out_dtype
    """The GEMM of already quantized activations (see the module doc)."""
    check_w8a8_operands(a, a_scale, weight, weight_scale, block_size)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}.")
    m, k = a.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    bucket = m_bucket(m)
    rows, cols = int(block_size[0]), int(block_size[1])
    if config is not None and not config.fits(bucket, cols, k % config.block_k == 0):
        raise ValueError(f"config {config} does not fit {m} rows in blocks of {cols} columns.")
    args = {
        "a_ptr": a, "as_ptr": a_scale, "w_ptr": weight, "s_ptr": weight_scale, "out_ptr": out,
        "M": m, "N": n, "K": k, "BLOCK_ROWS": rows, "BLOCK_COLS": cols,
        "stride_a": a.stride(0), "stride_w": weight.stride(0),
        "stride_as_m": a_scale.stride(0), "stride_as_g": a_scale.stride(1),
        "stride_s": weight_scale.stride(0), "stride_out": out.stride(0), "M_BUCKET": bucket,
    }  # fmt: skip
    if config is not None:
        args["BLOCK_M"] = config.tile_m(bucket)

    def grid(meta: dict) -> tuple[int]:
        block_m = meta.get("BLOCK_M", args.get("BLOCK_M"))  # the explicit config's: in args
        return (triton.cdiv(m, block_m) * triton.cdiv(n, meta["BLOCK_N"]),)

    launch_tuned(_fp8_block_w8a8_autotuned, _fp8_block_w8a8, grid, args, config)
    return out


def fp8_block_w8a8(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32
    weight: torch.Tensor,  # fp8 [N, K]
    weight_scale: torch.Tensor,  # fp32 [ceil(N / rows), ceil(K / cols)]
    block_size: tuple[int, int],  # (rows, cols)
    config: W8A8Config | None = None,  # None: autotuned
) -> torch.Tensor:  # [M, N] in x's dtype
    """x quantized per token and block column (kernels/fp8_group_quant.py), then the W8A8
    GEMM: the `BlockGemm` signature of kernels/fp8_block_gemm.py's W8A16 GEMM."""
    check_ndim("x", x, 2, "[M, K]")
    if len(block_size) != 2 or not w8a8_takes_block(tuple(block_size)):
        raise ValueError(
            f"block_size must be [rows, cols] with cols a multiple of {MIN_FP8_BLOCK_K} "
            f"(an FP8 K step inside one scale column), got {list(block_size)}."
        )
    a, a_scale = quantize_per_token_group_fp8(x, int(block_size[1]))
    return fp8_block_w8a8_quantized(a, a_scale, weight, weight_scale, block_size, x.dtype, config)


def ref_fp8_block_w8a8(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size: tuple[int, int],
) -> torch.Tensor:  # float64 [M, N]
    """The float64 product of the dequantized activations and weight (the kernel's exact
    value up to fp32 roundings)."""
    n, k = weight.shape
    rows, cols = block_size
    x = a.double() * a_scale.double().repeat_interleave(cols, 1)[:, :k]
    spread = weight_scale.double().repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)
    return x @ (weight.double() * spread[:, :k]).T
