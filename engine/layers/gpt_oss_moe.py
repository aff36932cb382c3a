"""GPT-OSS's mixture of experts: the grouped expert path of engine/layers/moe.py with
GPT-OSS's router and experts, which differ from Mixtral's in three ways:

- the router is a `Linear` with a bias, and the softmax runs over the top-k logits only
  (top-k first, then softmax: the weights of the chosen experts always sum to 1);
- every expert projection has a bias (`w13_bias`, `w2_bias`);
- the activation is a clamped SwiGLU: with gate clamped to (-inf, limit] and up to
  [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate).

Weights are stacked as in `FusedMoE`, with the gate rows first and the up rows second
(the checkpoint interleaves them, gate at even rows and up at odd ones; the family's loader
separates them, engine/models/gpt_oss.py)::

    router.weight [E, hidden]   router.bias [E]
    w13_weight    [E, 2 * inter, hidden]   w13_bias [E, 2 * inter]   gate | up
    w2_weight     [E, hidden, inter]       w2_bias  [E, hidden]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.layers.moe import MoESpec, grouped_gemm_impl, moe_experts
from engine.layers.ops import OpImpl


@dataclass(frozen=True)
class GptOssMoESpec(MoESpec):
    """MoESpec plus the clamped SwiGLU's constants (`swiglu_alpha`, `swiglu_limit`)."""

    alpha: float = 1.702
    limit: float = 7.0

    def build(self, hf_config: Any, impl: OpImpl) -> nn.Module:
        return GptOssMoE(hf_config, self, impl)


def select_experts_topk_softmax(
    router_logits: torch.Tensor,  # [T, num_experts]
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, top_k] weights, [T, top_k] int64 expert ids)
    """Top-k of the logits, then a softmax (fp32) over those k only, as transformers'
    GptOssTopKRouter; weights in the logits' dtype."""
    top, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=torch.float32).to(router_logits.dtype), ids


class ClampedSwiGLU(nn.Module):
    """[rows, 2 * inter] (gate | up) -> [rows, inter]: (up + 1) * gate * sigmoid(alpha * gate)
    after clamping gate above at `limit` and up to [-limit, limit]."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # [rows, inter] each
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


class GptOssMoE(nn.Module):
    def __init__(self, hf_config: Any, moe: GptOssMoESpec, impl: OpImpl) -> None:
        super().__init__()
        hidden, inter, num_experts = hf_config.hidden_size, moe.intermediate_size, moe.num_experts
        self.moe = moe
        self.router = Linear(hidden, num_experts, bias=True)
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * inter))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden))
        self._gemm = grouped_gemm_impl(impl)
        self.act_fn = ClampedSwiGLU(moe.alpha, moe.limit)

    @property
    def expert_param_shards(self) -> dict[str, tuple[int, ...] | None]:
        """Stacked expert parameters (the weight loader's and quantization's test for
        experts); the checkpoint always gives them whole, never per expert."""
        return {"w13_weight": None, "w13_bias": None, "w2_weight": None, "w2_bias": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, ids = select_experts_topk_softmax(self.router(x), self.moe.top_k)
        return moe_experts(
            x,
            self.w13_weight,
            self.w2_weight,
            weights,
            ids,
            self._gemm,
            self.act_fn,
            w13_bias=self.w13_bias,
            w2_bias=self.w2_bias,
        )

    def extra_repr(self) -> str:
        m = self.moe
        return f"experts={m.num_experts}, top_k={m.top_k}, alpha={m.alpha}, limit={m.limit}"
