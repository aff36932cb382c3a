"""DeepSeek-V3's mixture of experts: sigmoid-scored routing with a per-expert correction
bias and group-limited top-k, over the shared stacked-expert machinery of moe.py, plus
shared experts that every token goes through.

Routing, as transformers' `DeepseekV3TopkRouter` (in fp32)::

    scores  = sigmoid(x @ gate.weight^T)                  [T, E]
    choice  = scores + e_score_correction_bias            (the bias picks, never weighs)
    group   = sum of the top-2 `choice` in each of n_group groups of E / n_group experts
    keep the topk_group best groups; top_k experts among theirs by `choice`
    weights = scores of the chosen experts [/ their sum + 1e-20 where norm_topk_prob]
              * routed_scaling_factor

Checkpoint names: ``mlp.gate.weight`` and ``mlp.gate.e_score_correction_bias`` (the
router), ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` (or transformers 5's stacked
``mlp.experts.gate_up_proj`` / ``down_proj``), ``mlp.shared_experts.gate_proj/up_proj/
down_proj`` (one gated MLP of moe_intermediate_size * n_shared_experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from engine.layers.decoder_layers import DecoderSpec, GatedMLP
from engine.layers.moe import MoESpec, expert_scales, grouped_gemm_impl, moe_experts
from engine.layers.ops import OpImpl, SiluAndMul


@dataclass(frozen=True)
class GroupedTopK:
    """The router's settings, read from the config."""

    num_experts: int
    top_k: int
    num_groups: int
    topk_groups: int
    renormalize: bool
    routed_scaling_factor: float

    @classmethod
    def from_config(cls, hf_config: Any) -> GroupedTopK:
        num_experts = int(hf_config.n_routed_experts)
        routing = cls(
            num_experts=num_experts,
            top_k=int(hf_config.num_experts_per_tok),
            num_groups=int(getattr(hf_config, "n_group", None) or 1),
            topk_groups=int(getattr(hf_config, "topk_group", None) or 1),
            renormalize=bool(getattr(hf_config, "norm_topk_prob", True)),
            routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0)),
        )
        routing.check()
        return routing

    def check(self) -> None:
        if self.num_experts % self.num_groups:
            raise ValueError(
                f"n_routed_experts={self.num_experts} is not a multiple of "
                f"n_group={self.num_groups}."
            )
        if self.num_experts // self.num_groups < 2:
            raise ValueError("each expert group needs at least 2 experts (top-2 group score).")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group={self.topk_groups} must be in [1, n_group].")
        selectable = self.topk_groups * (self.num_experts // self.num_groups)
        if not 1 <= self.top_k <= selectable:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be in [1, {selectable}] (the experts "
                "of topk_group groups)."
            )


def select_experts_grouped(
    router_logits: torch.Tensor,  # [T, E] fp32
    bias: torch.Tensor,  # [E]
    routing: GroupedTopK,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, top_k] fp32 weights, [T, top_k] int64 ids)
    """The module doc's routing, step for step as transformers computes it."""
    num_tokens, num_experts = router_logits.shape
    groups = routing.num_groups
    scores = router_logits.sigmoid()
    choice = scores + bias.float()  # [T, E]
    group_scores = choice.view(num_tokens, groups, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    group_ids = torch.topk(group_scores, k=routing.topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1)  # [T, G]
    expert_mask = group_mask[:, :, None].expand(-1, -1, num_experts // groups)
    choice = choice.masked_fill(~expert_mask.reshape(num_tokens, -1).bool(), float("-inf"))
    ids = torch.topk(choice, k=routing.top_k, dim=-1, sorted=False)[1]  # [T, top_k]
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.routed_scaling_factor, ids


class GroupedTopKRouter(nn.Module):
    """`mlp.gate`: the router weight and its correction bias (fp32 arithmetic)."""

    def __init__(self, hidden_size: int, routing: GroupedTopK) -> None:
        super().__init__()
        self.routing = routing
        self.weight = nn.Parameter(torch.empty(routing.num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(routing.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x: [T, hidden]
        logits = torch.nn.functional.linear(x.float(), self.weight.float())  # [T, E]
        return select_experts_grouped(logits, self.e_score_correction_bias, self.routing)


@dataclass(frozen=True)
class DeepseekMoESpec(MoESpec):
    """MoESpec whose layer is `DeepseekMoE` (shared plus routed experts, group-limited
    top-k: read from the config); the first `first_k_dense_replace` layers are dense."""

    @classmethod
    def from_config(cls, hf_config: Any) -> DeepseekMoESpec:
        first_dense = int(getattr(hf_config, "first_k_dense_replace", None) or 0)
        return cls(
            num_experts=int(hf_config.n_routed_experts),
            top_k=int(hf_config.num_experts_per_tok),
            intermediate_size=int(hf_config.moe_intermediate_size),
            renormalize=bool(getattr(hf_config, "norm_topk_prob", True)),
            dense_layers=frozenset(range(first_dense)),
        )

    def build(self, hf_config: Any, impl: OpImpl) -> nn.Module:
        return DeepseekMoE(hf_config, impl)


class DeepseekMoE(nn.Module):
    keeps_fp8_experts = True  # its forward passes `expert_scales` (engine/layers/fp8_moe.py)

    def __init__(self, hf_config: Any, impl: OpImpl) -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"hidden_act={act!r} is not supported (silu).")
        routing = GroupedTopK.from_config(hf_config)
        hidden, inter = int(hf_config.hidden_size), int(hf_config.moe_intermediate_size)
        self.intermediate_size = inter
        self.gate = GroupedTopKRouter(hidden, routing)
        self.w13_weight = nn.Parameter(torch.empty(routing.num_experts, 2 * inter, hidden))
        self.w2_weight = nn.Parameter(torch.empty(routing.num_experts, hidden, inter))
        self.shared_experts: GatedMLP | None = None
        num_shared = int(getattr(hf_config, "n_shared_experts", None) or 0)
        if num_shared:
            shared = SimpleNamespace(
                hidden_act=act, hidden_size=hidden, intermediate_size=inter * num_shared
            )
            self.shared_experts = GatedMLP(shared, DecoderSpec(), impl)
        self._gemm = grouped_gemm_impl(impl)
        self.act_fn = SiluAndMul(impl)

    @property
    def expert_param_shards(self) -> dict[str, tuple[int, ...] | None]:
        """Stacked expert parameters and their shards' rows (read by the weight loader)."""
        inter = self.intermediate_size
        return {"w13_weight": (inter, inter), "w2_weight": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, ids = self.gate(x)
        out = moe_experts(
            x, self.w13_weight, self.w2_weight, weights, ids, self._gemm, self.act_fn,
            scales=expert_scales(self),
        )  # fmt: skip
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
