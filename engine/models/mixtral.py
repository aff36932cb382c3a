"""Mixtral (`MixtralForCausalLM`): Mistral's attention (and sliding window, where set) with
a mixture-of-experts MLP in every layer: top-k of `num_local_experts`, weights renormalised
over the chosen experts (engine/layers/moe.py).

The checkpoint keeps each expert's tensors under ``block_sparse_moe.experts.{e}.w1/w3/w2``
(gate, up, down) and the router under ``block_sparse_moe.gate``; transformers 5 writes
stacked ``mlp.experts.gate_up_proj`` / ``down_proj`` tensors, which load as they are."""

from __future__ import annotations

from typing import Any, ClassVar

from engine.layers.decoder_layers import DecoderSpec
from engine.layers.moe import MoESpec
from engine.models.decoder import DecoderForCausalLM

# Checkpoint names, after `weight_name_substitutions`, onto our stacked parameters.
STACKED_EXPERT_NAMES = (
    (".mlp.experts.gate_up_proj", ".mlp.w13_weight"),
    (".mlp.experts.down_proj", ".mlp.w2_weight"),
)


class MixtralForCausalLM(DecoderForCausalLM):
    supports_tensor_parallel = False  # experts are not split over ranks (yet)
    expert_weights_mapping: ClassVar[dict[str, tuple[str, int | None]] | None] = {
        "w1": ("w13_weight", 0),
        "w3": ("w13_weight", 1),
        "w2": ("w2_weight", None),
    }
    weight_name_substitutions: ClassVar[tuple[tuple[str, str], ...]] = (
        (".block_sparse_moe.", ".mlp."),
        *STACKED_EXPERT_NAMES,
    )

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        moe = MoESpec(
            num_experts=int(config.num_local_experts),
            top_k=int(config.num_experts_per_tok),
            intermediate_size=int(config.intermediate_size),
            renormalize=True,
        )
        return DecoderSpec(qkv_bias=bias, o_bias=bias, moe=moe)
