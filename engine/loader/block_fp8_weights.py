"""Which projections of a block-scaled FP8 checkpoint keep their FP8 weights (CUDA, or forced
by $PAGEDSERVE_FP8_COMPUTE=fp8), installed while the model is still on meta.

Every projection `Linear` the config quantizes becomes a block FP8 layer
(engine/layers/fp8_block_linear.py) unless it cannot be one: a fused layer whose shards' rows
are not whole blocks, a tensor-parallel slice, a weight read as a float matrix, or a block
shape the kernel does not take; those are listed (the loader says so once) and stream in
dequantized, as every weight does elsewhere. Mixture-of-experts experts are stacked
parameters, not `Linear`s: engine/loader/fp8_expert_weights.py keeps them (the grouped FP8
GEMM). The LM head and the MoE routers stay float.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from engine.config.weights.fp8_checkpoint import Fp8Scheme
from engine.layers.fp8_block_linear import BlockGemm, keep_reason, make_block_fp8
from engine.loader.fp8_weights import quantized_linears


def install_block_fp8_layers(
    model: nn.Module,
    scheme: Fp8Scheme,
    packed: Mapping[str, tuple[str, ...]],
    gemm: BlockGemm,
    kernel_takes_block: bool = True,
    prefill_gemm: BlockGemm | None = None,
) -> tuple[frozenset[str], list[str]]:
    """Returns (the checkpoint modules now kept in FP8, "<layer>: <why>" for the quantized
    layers left dequantized). `prefill_gemm`: the W8A8 GEMM for many rows, where the device
    runs it (engine/layers/fp8_block_linear.py)."""
    block = scheme.block_size
    assert block is not None, "a block-scaled scheme has a block size"
    kept: set[str] = set()
    dequantized: list[str] = []
    for name, layer, members in quantized_linears(model, scheme, packed):
        reason = keep_reason(layer, block)
        if reason is None and not kernel_takes_block:
            reason = f"the kernel does not take blocks {list(block)}"
        if reason is not None:
            dequantized.append(f"{name}: {reason}")
            continue
        make_block_fp8(layer, block, gemm, prefill_gemm)
        kept.update(members)
    return frozenset(kept), dequantized
