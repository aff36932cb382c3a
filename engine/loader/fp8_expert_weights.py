"""Which mixture-of-experts layers of an FP8 checkpoint keep their experts FP8 (CUDA with
Triton, or forced by $PAGEDSERVE_FP8_COMPUTE=fp8), installed while the model is still on
meta (engine/layers/fp8_moe.py).

The checkpoint stores each expert's projections as their own modules
(``mlp.experts.{e}.gate_proj`` ...: the family's `expert_weights_mapping`); a layer whose
experts are all quantized by the config becomes an FP8 experts layer unless it cannot be
one (`experts_keep_reason`: gate | up rows that are not whole blocks, a tensor-parallel
slice; or a block shape the kernel does not take), and its checkpoint modules are returned
so that the FP8 stream (engine/loader/fp8_weights.py) passes their weights and scales
through instead of dequantizing them. The names are the checkpoint's: our module name with
the family's `weight_name_substitutions` undone (Mixtral's ``.block_sparse_moe.``).
Layers the config leaves unquantized are float already; a layer with some experts
quantized and some not is kept dequantized.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.config.weights.fp8_checkpoint import Fp8Scheme, is_ignored
from engine.layers.fp8_block_linear import keeps_block_fp8, triton_available
from engine.layers.fp8_moe import (
    Fp8MoEKernel,
    experts_keep_reason,
    fp8_moe_kernel,
    fp8_moe_w8a8_kernel,
    make_fp8_experts,
    moe_block_fits_kernel,
)


def _checkpoint_names(name: str, substitutions: tuple[tuple[str, str], ...]) -> set[str]:
    """`name` and each spelling the checkpoint may use for it (substitutions undone)."""
    names = {name}
    for old, new in substitutions:
        names |= {n.replace(new, old) for n in names if new in n}
    return names


def expert_modules(
    prefix: str,
    num_experts: int,
    mapping: Mapping[str, tuple[str, int | None]],
    substitutions: tuple[tuple[str, str], ...] = (),
) -> Iterator[str]:
    """The checkpoint modules of one layer's experts (`<prefix>.experts.{e}.<leaf>`)."""
    for e in range(num_experts):
        for leaf in mapping:
            yield from sorted(_checkpoint_names(f"{prefix}.experts.{e}.{leaf}", substitutions))


def install_fp8_experts(
    model: nn.Module,
    scheme: Fp8Scheme,
    mapping: Mapping[str, tuple[str, int | None]] | None,
    substitutions: tuple[tuple[str, str], ...],
    kernel: Fp8MoEKernel,
    kernel_takes_block: bool = True,
    prefill_kernel: Fp8MoEKernel | None = None,
) -> tuple[frozenset[str], int, list[str]]:
    """Returns (the checkpoint modules now kept in FP8, how many layers keep their experts,
    "<layer> experts: <why>" for the quantized ones left dequantized). `prefill_kernel`:
    the W8A8 grouped GEMM for busy steps, where the device runs it."""
    if not mapping:
        return frozenset(), 0, []
    block = scheme.block_size
    kept: set[str] = set()
    num_layers = 0
    dequantized: list[str] = []
    for name, module in model.named_modules():
        if not getattr(module, "keeps_fp8_experts", False):
            continue
        num_experts = module.w13_weight.shape[0]
        members = [f"{name}.experts.{e}.{leaf}" for e in range(num_experts) for leaf in mapping]
        ignored = [
            any(is_ignored(n, scheme.ignore) for n in _checkpoint_names(m, substitutions))
            for m in members
        ]
        if all(ignored):
            continue
        reason = experts_keep_reason(module, block)
        if reason is None and any(ignored):
            reason = "the checkpoint quantizes some of its experts and not others"
        if reason is None and block is not None and not kernel_takes_block:
            reason = f"the kernel does not take blocks {list(block)}"
        if reason is not None:
            dequantized.append(f"{name} experts: {reason}")
            continue
        make_fp8_experts(module, block, kernel, prefill_kernel)
        kept.update(expert_modules(name, num_experts, mapping, substitutions))
        num_layers += 1
    return frozenset(kept), num_layers, dequantized


@dataclass
class KeptExperts:
    """What one load did with an FP8 checkpoint's experts."""

    modules: frozenset[str] = frozenset()  # checkpoint modules passed through as FP8
    num_layers: int = 0  # MoE layers whose experts stay FP8
    dequantized: list[str] = field(default_factory=list)  # "<layer> experts: <why>"

    def said(self) -> str:
        """The load's log line's part about them ("" where no layer keeps them)."""
        if not self.num_layers:
            return ""
        return f", and the experts of {self.num_layers} MoE layers (the Triton grouped GEMM)"


def keep_fp8_experts(
    model: nn.Module, scheme: Fp8Scheme, device: torch.device, forced: bool | None
) -> KeptExperts:
    """The block FP8 projections' rule for every FP8 checkpoint's experts (block-scaled,
    per channel or per tensor: the grouped GEMM is W8A16, so no FP8 tensor cores needed):
    kept where Triton runs (CUDA with Triton installed), or where `forced`
    ($PAGEDSERVE_FP8_COMPUTE) says so and Triton is installed; elsewhere dequantized."""
    if not keeps_block_fp8(device, forced) or not triton_available():
        return KeptExperts()
    block = scheme.block_size
    modules, num_layers, dequantized = install_fp8_experts(
        model,
        scheme,
        getattr(model, "expert_weights_mapping", None),
        getattr(model, "weight_name_substitutions", ()),
        fp8_moe_kernel(),
        kernel_takes_block=block is None or moe_block_fits_kernel(block),
        prefill_kernel=fp8_moe_w8a8_kernel(device, block),
    )
    return KeptExperts(modules, num_layers, dequantized)
