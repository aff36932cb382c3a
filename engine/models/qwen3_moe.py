"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (per-head q/k RMSNorm) with a
mixture-of-experts MLP: top-k of `num_experts` experts of `moe_intermediate_size`, the
weights renormalised only where `norm_topk_prob` says so. Layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step` rhythm, keep a dense gated MLP of
`intermediate_size`, as transformers builds them.

Checkpoint: ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` and the router ``mlp.gate``."""

from __future__ import annotations

from typing import Any, ClassVar

from engine.layers.decoder_layers import DecoderSpec
from engine.layers.moe import MoESpec
from engine.models.decoder import DecoderForCausalLM
from engine.models.mixtral import STACKED_EXPERT_NAMES


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    supports_tensor_parallel = False  # experts are not split over ranks (yet)
    expert_weights_mapping: ClassVar[dict[str, tuple[str, int | None]] | None] = {
        "gate_proj": ("w13_weight", 0),
        "up_proj": ("w13_weight", 1),
        "down_proj": ("w2_weight", None),
    }
    weight_name_substitutions: ClassVar[tuple[tuple[str, str], ...]] = STACKED_EXPERT_NAMES

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        num_experts = int(getattr(config, "num_experts", None) or config.num_local_experts)
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        only_mlp = set(getattr(config, "mlp_only_layers", None) or ())
        dense = frozenset(
            i
            for i in range(config.num_hidden_layers)
            if i in only_mlp or num_experts == 0 or (i + 1) % step != 0
        )
        if num_experts == 0:  # every layer dense
            return DecoderSpec(qkv_bias=bias, o_bias=bias, qk_norm=True)
        moe = MoESpec(
            num_experts=num_experts,
            top_k=int(config.num_experts_per_tok),
            intermediate_size=int(config.moe_intermediate_size),
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            dense_layers=dense,
        )
        return DecoderSpec(qkv_bias=bias, o_bias=bias, qk_norm=True, moe=moe)
