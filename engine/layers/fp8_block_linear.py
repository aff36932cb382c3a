"""Block-scaled FP8 projections kept in FP8: `Fp8BlockLinearMethod`.

A projection of a block-scaled FP8 checkpoint (engine/config/weights/block_fp8_checkpoint.py:
Qwen3-*-FP8, DeepSeek-V3, compressed-tensors FP8_BLOCK) keeps its E4M3 weight and the
checkpoint's grid of fp32 scales, one per [rows, cols] block; each call runs a Triton GEMM::

    x [M, K] ──▶ M <= max_kernel_rows, or no FP8 tensor cores:
                     fp8_block_gemm(x, W_q [N, K] fp8, S [ceil(N/rows), ceil(K/cols)] fp32)
                     (W8A16, kernels/fp8_block_gemm.py: weight tiles converted in registers)
                 more rows, FP8 tensor cores (sm_89+):
                     fp8_block_w8a8(x, W_q, S)   (W8A8, kernels/fp8_block_w8a8.py: x quantized
                     per token and block column, fp8 x fp8 dots)
             ──▶ out [M, N] (+ bias)

Decode rows read the weight once and are bound by its bytes: the W8A16 GEMM reads it at one
byte a value and needs no quantization of the activations. Prefill rows are bound by the
tensor cores: there the FP8 ones (twice bf16's peak on Hopper) are worth the activations'
extra quantization kernel and its error (half an E4M3 step per value, scaled per 1 x cols
group). The
row count where they cross is measured per shape on the GPU at load: the method is a
`TwoRoutes` one (engine/layers/crossover.py; `BLOCK_FP8_W8A16_MAX_ROWS` until then, with
$PAGEDSERVE_KERNEL_ROWS=off, or a fixed count with $PAGEDSERVE_KERNEL_ROWS=<rows>). Blocks
whose columns are not a multiple of 32 (FP8 dots step K by 32 at least) keep the W8A16
route at every row count. A fused projection (q | k | v, gate | up)
stacks its shards' rows, and so their scale grids' rows: shard i's weight rows start at
sum(output_sizes[:i]) and its scale rows at that divided by the block's rows, which is a
whole number only when every shard's row count is a multiple of the block's rows
(`fused_rows_fit`). A layer where it is not (ragged shard rows), or whose rows or columns
are split over tensor-parallel ranks (the grid would need the same cut), or that something
reads as a float matrix outside its forward (MLA's `kv_b_proj`), stays dequantized.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from engine.layers.fp8_linear import fp8_tensor_cores
from engine.layers.linear import Linear

FP8_DTYPE = torch.float8_e4m3fn
# (x [M, K], weight fp8 [N, K], scale grid fp32, (rows, cols)) -> [M, N]
BlockGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int]], torch.Tensor]

# Rows up to which a layer with both GEMMs runs the W8A16 one until the crossover is measured
# (or with the measurement off). Not measured: a roofline guess. At m rows the W8A16 GEMM
# does 2m flops per weight byte it reads; an H200's (H100's) bf16 tensor cores need about
# 200 (300) per byte of HBM to be the bound, so below ~100 rows the weight's bytes bound
# both GEMMs and the W8A8 one would only add its quantization launch.
BLOCK_FP8_W8A16_MAX_ROWS = 64


class Fp8BlockLinearMethod:
    """The `LinearMethod` of a block-scaled FP8 projection: reads the layer's `weight`
    (fp8 [N, K]) and `weight_scale` (fp32 block grid) at each call, so sleep/wake's swaps
    of `.data` are seen. With a `prefill_gemm` (the W8A8 GEMM: `block_fp8_w8a8_kernel`)
    rows beyond `max_kernel_rows` take it, and it is a `TwoRoutes` method
    (engine/layers/crossover.py), which measures that threshold; without one the W8A16
    `gemm` runs every row count."""

    def __init__(
        self,
        layer: Linear,
        block_size: tuple[int, int],
        gemm: BlockGemm,
        prefill_gemm: BlockGemm | None = None,
        max_kernel_rows: int | None = None,
    ) -> None:
        self.layer = layer
        self.block_size = block_size
        self.gemm = gemm
        self.prefill_gemm = prefill_gemm
        if max_kernel_rows is None:
            max_kernel_rows = BLOCK_FP8_W8A16_MAX_ROWS  # read at build: tests move it
        self.max_kernel_rows = max_kernel_rows

    @property
    def in_features(self) -> int:
        return self.layer.weight.shape[1]

    def crossover_key(self) -> str | None:
        if self.prefill_gemm is None:
            return None
        n, k = self.layer.weight.shape
        rows, cols = self.block_size
        return f"fp8-block {n}x{k} {rows}x{cols}"

    def route(self, x: torch.Tensor, kernel: bool) -> torch.Tensor:  # [M, K] -> [M, N]
        """The W8A16 GEMM (`kernel`, or no other) or the W8A8 one."""
        gemm = self.gemm if kernel or self.prefill_gemm is None else self.prefill_gemm
        return gemm(x, self.layer.weight, self.layer.weight_scale, self.block_size)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n, k = self.layer.weight.shape
        x2 = x.reshape(-1, k).contiguous()  # [M, K]
        out = self.route(x2, kernel=x2.shape[0] <= self.max_kernel_rows)  # [M, N]
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], n)


def scale_grid_shape(
    out_features: int, in_features: int, block: tuple[int, int]
) -> tuple[int, int]:  # [ceil(N / rows), ceil(K / cols)]
    rows, cols = block
    return -(-out_features // rows), -(-in_features // cols)


def fused_rows_fit(layer: Linear, block: tuple[int, int]) -> bool:
    """Whether the shards' scale grids stack: every shard's rows a multiple of the block's
    (an unfused layer always fits, ragged last block and all)."""
    sizes = layer.output_sizes
    return sizes is None or len(sizes) == 1 or all(size % block[0] == 0 for size in sizes)


def keep_reason(layer: Linear, block: tuple[int, int]) -> str | None:
    """None where the layer can keep its block FP8 weight, else why it cannot."""
    if getattr(layer, "float_weight_only", False):
        return "its weight is read as a float matrix"
    if getattr(layer, "checkpoint_slices", None):
        return "its weight is split over tensor-parallel ranks"
    if not fused_rows_fit(layer, block):
        return f"its fused shards' rows {list(layer.output_sizes or ())} are not whole blocks"
    return None


def make_block_fp8(
    layer: Linear,
    block: tuple[int, int],
    gemm: BlockGemm,
    prefill_gemm: BlockGemm | None = None,
) -> None:
    """On a meta-built layer: an FP8 `weight` [N, K] and an fp32 `weight_scale` block grid
    for the loader to fill (shard i's scale rows at its weight rows / block rows:
    `shard_row_blocks`), and the method that computes with them."""
    out_features, in_features = layer.weight.shape
    device = layer.weight.device
    layer.weight = torch.nn.Parameter(
        torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
        requires_grad=False,
    )
    layer.weight_scale = torch.nn.Parameter(
        torch.empty(
            scale_grid_shape(out_features, in_features, block), dtype=torch.float32, device=device
        ),
        requires_grad=False,
    )
    layer.shard_row_blocks = {"weight_scale": block[0]}
    layer.packed_weight = None
    layer.quant_method = Fp8BlockLinearMethod(layer, block, gemm, prefill_gemm)


def triton_available() -> bool:
    """Whether Triton is installed (a dependency on Linux x86_64; the GEMM needs nothing
    else: no FP8 tensor cores, any GPU Triton compiles for)."""
    return importlib.util.find_spec("triton") is not None


def keeps_block_fp8(device: torch.device, forced: bool | None) -> bool:
    """Whether a block-scaled FP8 checkpoint keeps its weights FP8 on `device`: `forced`
    ($PAGEDSERVE_FP8_COMPUTE: True "fp8", False "dequantize") where set, else where the
    Triton kernel runs: CUDA with Triton installed."""
    if forced is not None:
        return forced
    return device.type == "cuda" and triton_available()


def block_fp8_gemm_kernel() -> BlockGemm:
    """kernels/fp8_block_gemm.py (Triton: CUDA, or the interpreter in the tests)."""
    from kernels.fp8_block_gemm import fp8_block_gemm

    return fp8_block_gemm


def block_fits_kernel(block: tuple[int, int]) -> bool:
    """Whether the kernel takes this block shape (columns with a power-of-two divisor of at
    least 16; the served 128 x 128 does)."""
    from kernels.fp8_block_gemm import kernel_takes_block

    return kernel_takes_block(block)


def block_fp8_w8a8_kernel(device: torch.device, block: tuple[int, int]) -> BlockGemm | None:
    """The prefill GEMM, kernels/fp8_block_w8a8.py (W8A8), where it runs: a block whose
    columns are a multiple of 32, on FP8 tensor cores (CUDA sm_89+); None elsewhere (older
    GPUs, and the CPU's interpreter when $PAGEDSERVE_FP8_COMPUTE=fp8 forces block FP8
    there: the W8A16 GEMM at every row count)."""
    from kernels.fp8_block_w8a8 import fp8_block_w8a8, w8a8_takes_block

    if not w8a8_takes_block(block) or not fp8_tensor_cores(device):
        return None
    return fp8_block_w8a8
