"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks `top_k` experts per token,
each expert is a gated MLP, and the token's output is their weighted sum. (GPT-OSS's router
and biased experts build on the same grouped path: engine/layers/gpt_oss_moe.py.)

Weights are stacked per layer, one tensor per projection (a fused MoE path needs them so):

    gate.weight   [num_experts, hidden]                the router (a `Linear`)
    w13_weight    [num_experts, 2 * inter, hidden]     each expert's gate | up rows
    w2_weight     [num_experts, hidden, inter]         each expert's down projection

The checkpoint's per-expert tensors (`experts.{e}.w1/w3/w2` in Mixtral, `experts.{e}.
gate_proj/up_proj/down_proj` in Qwen3-MoE) are placed by the generic loader from the
family's `expert_weights_mapping` (engine/loader/weight_loader.py).

Routing follows transformers: softmax over the router logits in fp32, top-k, and the
checkpoint's renormalisation rule (`renormalize`: Mixtral always, Qwen3-MoE where
`norm_topk_prob`). The experts then run grouped: the T x top_k (token, expert) rows are
sorted by expert, and each projection is one grouped GEMM over the sorted rows
(`moe_experts`), by the implementation chosen when the model is built:

    torch    a reference: one matmul per expert with rows, in a Python loop over experts
    native   one C call per projection (engine/native/moe_kernels.c), no Python loop
    triton   one Triton launch per projection (kernels/fused_moe.py)

An FP8 checkpoint's experts may instead stay FP8 (CUDA, through Triton): the loader swaps
in FP8 stacks, their scales (`w13_weight_scale`, `w2_weight_scale`) and the grouped FP8
GEMM (engine/layers/fp8_moe.py); `expert_scales` hands the scales to each call.

The rows' outputs, weighted by their routing weights, are summed back into their tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.layers.ops import GeluTanhAndMul, OpImpl, SiluAndMul
from engine.native import moe_grouped_gemm


@dataclass(frozen=True)
class MoESpec:
    """A family's MoE settings, read from its config."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # divide the top-k weights by their sum
    dense_layers: frozenset[int] = frozenset()  # layers with a plain gated MLP instead

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]."
            )

    def build(self, hf_config: Any, impl: OpImpl) -> nn.Module:
        """The MoE layer this spec describes (a family with other routing or experts
        subclasses the spec and builds its own layer: engine/layers/gpt_oss_moe.py)."""
        return FusedMoE(hf_config, self, impl)


def select_experts(
    router_logits: torch.Tensor,  # [T, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, top_k] weights, [T, top_k] int64 expert ids)
    """Softmax in fp32, top-k, optional renormalisation; weights in the logits' dtype."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


@dataclass
class ExpertRows:
    """The (token, expert) rows of a step sorted by expert."""

    token: torch.Tensor  # [T * top_k] int64: the token of each sorted row
    weight: torch.Tensor  # [T * top_k]: its routing weight
    offsets: list[int]  # [num_experts + 1]: expert e owns rows offsets[e]:offsets[e + 1]


def sort_rows(weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> ExpertRows:
    flat = ids.flatten()  # [T * top_k], row r is token r // top_k
    order = torch.argsort(flat, stable=True)  # tokens ascending within an expert
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = [0, *torch.cumsum(counts, 0).tolist()]
    return ExpertRows(order // ids.shape[1], weights.flatten()[order], offsets)


# (x, rows, weight, offsets[, scale]) -> out; the scale only for FP8 experts
GroupedGemm = Callable[..., torch.Tensor]


def torch_grouped_gemm(
    x: torch.Tensor, rows: torch.Tensor | None, weight: torch.Tensor, offsets: list[int]
) -> torch.Tensor:
    """The reference: out[i] = x[rows[i]] @ weight[e].T, one matmul per expert with rows."""
    gathered = x if rows is None else x[rows]  # [M, k]
    out = x.new_empty(offsets[-1], weight.shape[1])
    for expert in range(weight.shape[0]):
        start, end = offsets[expert], offsets[expert + 1]
        if end > start:
            torch.mm(gathered[start:end], weight[expert].t(), out=out[start:end])
    return out


def _native_grouped_gemm(
    x: torch.Tensor, rows: torch.Tensor | None, weight: torch.Tensor, offsets: list[int]
) -> torch.Tensor:
    return moe_grouped_gemm(x, rows, weight, torch.tensor(offsets, dtype=torch.int64))


def _triton_grouped_gemm(
    x: torch.Tensor, rows: torch.Tensor | None, weight: torch.Tensor, offsets: list[int]
) -> torch.Tensor:
    from kernels.fused_moe import moe_grouped_gemm

    return moe_grouped_gemm(x, rows, weight, offsets)


def grouped_gemm_impl(impl: OpImpl) -> GroupedGemm:
    if impl == "native":
        return _native_grouped_gemm
    if impl == "triton":
        return _triton_grouped_gemm
    return torch_grouped_gemm


def expert_scales(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The stacked scales of a layer whose experts stay FP8 (read at each call, so
    sleep/wake's swaps are seen), or None for float experts."""
    w13_scale = getattr(module, "w13_weight_scale", None)
    return None if w13_scale is None else (w13_scale, module.w2_weight_scale)


def _project(
    gemm: GroupedGemm,
    x: torch.Tensor,
    rows: torch.Tensor | None,
    weight: torch.Tensor,
    offsets: list[int],
    scale: torch.Tensor | None,
) -> torch.Tensor:
    return (
        gemm(x, rows, weight, offsets) if scale is None else gemm(x, rows, weight, offsets, scale)
    )


def moe_experts(
    x: torch.Tensor,  # [T, hidden]
    w13: torch.Tensor,  # [E, 2 * inter, hidden]
    w2: torch.Tensor,  # [E, hidden, inter]
    weights: torch.Tensor,  # [T, top_k]
    ids: torch.Tensor,  # [T, top_k]
    gemm: GroupedGemm,
    act_and_mul: Callable[[torch.Tensor], torch.Tensor],
    *,
    w13_bias: torch.Tensor | None = None,  # [E, 2 * inter]
    w2_bias: torch.Tensor | None = None,  # [E, hidden]
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # FP8 experts' (w13, w2)
) -> torch.Tensor:  # [T, hidden]
    """sum_k weights[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = ids[t, k]; each
    projection plus its expert's bias where given (GPT-OSS); `scales` go to the GEMM with
    their weights (FP8 experts: engine/layers/fp8_moe.py)."""
    w13_scale, w2_scale = (None, None) if scales is None else scales
    rows = sort_rows(weights, ids, w13.shape[0])
    h = _project(gemm, x, rows.token, w13, rows.offsets, w13_scale)  # [T * top_k, 2 * inter]
    expert = None
    if w13_bias is not None or w2_bias is not None:  # each sorted row's expert
        counts = torch.tensor(rows.offsets, device=x.device).diff()  # [E]
        expert = torch.repeat_interleave(torch.arange(w13.shape[0], device=x.device), counts)
    if w13_bias is not None:
        h += w13_bias[expert]
    y = _project(gemm, act_and_mul(h), None, w2, rows.offsets, w2_scale)  # [T * top_k, hidden]
    if w2_bias is not None:
        y += w2_bias[expert]
    y.mul_(rows.weight[:, None].to(y.dtype))
    return torch.zeros_like(x).index_add_(0, rows.token, y)


class FusedMoE(nn.Module):
    keeps_fp8_experts = True  # its forward passes `expert_scales` (engine/layers/fp8_moe.py)

    def __init__(self, hf_config: Any, moe: MoESpec, impl: OpImpl) -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise NotImplementedError(
                f"hidden_act={act!r} is not supported (silu, gelu_pytorch_tanh)."
            )
        hidden, inter, num_experts = hf_config.hidden_size, moe.intermediate_size, moe.num_experts
        self.moe = moe
        self.gate = Linear(hidden, num_experts, bias=False)
        self.gate.is_router = True  # never kept quantized (engine/loader/fp8_weights.py)
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self._gemm = grouped_gemm_impl(impl)
        self.act_fn: nn.Module = SiluAndMul(impl) if act == "silu" else GeluTanhAndMul()

    @property
    def expert_param_shards(self) -> dict[str, tuple[int, ...] | None]:
        """Stacked expert parameters and their shards' rows (read by the weight loader)."""
        inter = self.moe.intermediate_size
        return {"w13_weight": (inter, inter), "w2_weight": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, ids = select_experts(self.gate(x), self.moe.top_k, self.moe.renormalize)
        return moe_experts(
            x, self.w13_weight, self.w2_weight, weights, ids, self._gemm, self.act_fn,
            scales=expert_scales(self),
        )  # fmt: skip

    def extra_repr(self) -> str:
        m = self.moe
        return f"experts={m.num_experts}, top_k={m.top_k}, renormalize={m.renormalize}"
