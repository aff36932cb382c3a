"""Mixture-of-experts experts kept in FP8: the stacked weights of an FP8 checkpoint's experts
stay E4M3, with their scales stacked per expert beside them, and each projection runs the
Triton grouped W8A16 GEMM (kernels/fused_moe_fp8.py), which dequantizes the weight tiles in
registers::

    w13_weight        fp8 [E, 2 * inter, hidden]   w13_weight_scale  fp32 scales of each
    w2_weight         fp8 [E, hidden, inter]       w2_weight_scale   expert, stacked:

      block-scaled (transformers' `weight_block_size`, FP8_BLOCK)  [E, ceil(N/rows), ceil(K/cols)]
      per channel or per tensor (compressed-tensors, ModelOpt)     [E, N] (a per-tensor scale
                                                                   spread over its rows)

Why: experts are most of an MoE checkpoint's bytes (>95 % of DeepSeek-V3's 671 B
parameters), so dequantizing them at load doubles the memory a replica needs (~650 GB of FP8
become ~1.3 TB of bf16: no longer one 8-GPU node) and the bytes a decode step reads.

Gate and up are separate checkpoint modules stacked into w13's rows (`expert_param_shards`):
shard i's rows start at i * inter and, in a block grid, its scale rows at i * inter / rows,
a whole number only where `inter` is a multiple of the block's rows (Qwen3-30B-A3B: 768 in
blocks of 128; DeepSeek-V3: 2048). A layer where it is not, or whose experts are split over
tensor-parallel ranks (the grid would need the same cut), keeps its experts dequantized
(`experts_keep_reason`). The layer reads its weights and scales at each call, so sleep/wake's
swaps of `.data` are seen.

Prefill on FP8 tensor cores: block-scaled experts get a second kernel where the device has
them (sm_89+), the W8A8 grouped GEMM of kernels/fused_moe_fp8_w8a8.py (activations
quantized per token and block column, fp8 x fp8 dots). A step takes it when some expert has
more than `max_expert_rows` rows (`FP8_MOE_W8A16_MAX_EXPERT_ROWS`): an expert's weight is
read once for all its rows, so its rows, not the step's, decide whether the weight's bytes
or the tensor cores bound the work (engine/layers/fp8_block_linear.py's reasoning).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
# (x, rows, weight fp8 [E, N, K], scale, offsets, block | None) -> [M, N]
Fp8MoEKernel = Callable[..., torch.Tensor]
EXPERT_WEIGHTS = ("w13_weight", "w2_weight")
# Rows of the busiest expert up to which a step runs the W8A16 grouped GEMM where the W8A8
# one is there too. Not measured (benchmarks/gpu/fp8_moe.py does not time W8A8 yet): the
# dense layers' roofline guess, `BLOCK_FP8_W8A16_MAX_ROWS`.
FP8_MOE_W8A16_MAX_EXPERT_ROWS = 64


class Fp8ExpertGemm:
    """The grouped GEMM of a layer with FP8 experts: moe.py's `GroupedGemm` with the
    projection's stacked scales (block grids where `block` is set, else per row), and with
    a `prefill_kernel` (W8A8) for steps whose busiest expert has more than
    `max_expert_rows` rows."""

    def __init__(
        self,
        block: tuple[int, int] | None,
        kernel: Fp8MoEKernel,
        prefill_kernel: Fp8MoEKernel | None = None,
    ) -> None:
        self.block = block
        self.kernel = kernel
        self.prefill_kernel = prefill_kernel
        self.max_expert_rows = FP8_MOE_W8A16_MAX_EXPERT_ROWS  # read at build: tests move it

    def __call__(
        self,
        x: torch.Tensor,  # [num_x_rows, K]
        rows: torch.Tensor | None,  # [M] int64
        weight: torch.Tensor,  # fp8 [E, N, K]
        offsets: list[int],  # E + 1
        scale: torch.Tensor,  # fp32 stacked scales
    ) -> torch.Tensor:  # [M, N]
        kernel = self.kernel
        if self.prefill_kernel is not None and busiest(offsets) > self.max_expert_rows:
            kernel = self.prefill_kernel
        return kernel(x, rows, weight, scale, offsets, self.block)


def busiest(offsets: list[int]) -> int:
    """The most rows any expert has in a step."""
    return max((b - a for a, b in itertools.pairwise(offsets)), default=0)


def expert_scale_shape(
    num_experts: int, out_features: int, in_features: int, block: tuple[int, int] | None
) -> tuple[int, ...]:
    if block is None:
        return (num_experts, out_features)
    return (num_experts, -(-out_features // block[0]), -(-in_features // block[1]))


def experts_keep_reason(module: nn.Module, block: tuple[int, int] | None) -> str | None:
    """None where the layer's experts can stay FP8, else why they cannot."""
    if getattr(module, "checkpoint_slices", None):
        return "its experts are split over tensor-parallel ranks"
    shards = module.expert_param_shards["w13_weight"]  # type: ignore[operator, index]
    if block is not None and shards is not None and any(s % block[0] for s in shards):
        return f"its experts' gate | up rows {list(shards)} are not whole blocks of {block[0]}"
    return None


def make_fp8_experts(
    module: nn.Module,
    block: tuple[int, int] | None,
    kernel: Fp8MoEKernel,
    prefill_kernel: Fp8MoEKernel | None = None,
) -> None:
    """On a meta-built MoE layer: FP8 `w13_weight` / `w2_weight` and fp32 `*_scale` stacks
    for the loader to fill (w13's scale shards at its weight shards' rows / block rows:
    `expert_scale_shards`, read by the weight loader), and the GEMM that runs them."""
    for leaf in EXPERT_WEIGHTS:
        weight = getattr(module, leaf)
        num_experts, out_features, in_features = weight.shape
        setattr(
            module,
            leaf,
            nn.Parameter(torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device),
                         requires_grad=False),
        )  # fmt: skip
        scale = torch.empty(
            expert_scale_shape(num_experts, out_features, in_features, block),
            dtype=torch.float32,
            device=weight.device,
        )
        setattr(module, f"{leaf}_scale", nn.Parameter(scale, requires_grad=False))
    shards = module.expert_param_shards["w13_weight"]  # type: ignore[operator, index]
    rows = 1 if block is None else block[0]
    module.expert_scale_shards = {
        "w13_weight_scale": None if shards is None else tuple(s // rows for s in shards),
        "w2_weight_scale": None,
    }
    module._gemm = Fp8ExpertGemm(block, kernel, prefill_kernel)


def fp8_moe_kernel() -> Fp8MoEKernel:
    """kernels/fused_moe_fp8.py (Triton: CUDA, or the interpreter in the tests)."""
    from kernels.fused_moe_fp8 import fp8_moe_grouped_gemm

    return fp8_moe_grouped_gemm


def moe_block_fits_kernel(block: tuple[int, int]) -> bool:
    """Whether the grouped kernel takes this block shape (the dense block GEMM's rule)."""
    from kernels.fp8_block_gemm import kernel_takes_block

    return kernel_takes_block(block)


def fp8_moe_w8a8_kernel(device: torch.device, block: tuple[int, int] | None) -> Fp8MoEKernel | None:
    """The prefill kernel, kernels/fused_moe_fp8_w8a8.py (W8A8), where it runs: block-scaled
    experts whose blocks' columns are a multiple of 32, on FP8 tensor cores (CUDA sm_89+);
    None elsewhere (per-channel experts, older GPUs, the CPU's interpreter)."""
    from engine.layers.fp8_linear import fp8_tensor_cores
    from kernels.fp8_block_w8a8 import w8a8_takes_block

    if block is None or not w8a8_takes_block(block) or not fp8_tensor_cores(device):
        return None
    from kernels.fused_moe_fp8_w8a8 import fp8_moe_w8a8

    return fp8_moe_w8a8
