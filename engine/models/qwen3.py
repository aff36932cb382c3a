"""Qwen3: the shared decoder with a per-head RMSNorm on q and k before the rotation, and
q/k/v/o biases only where `attention_bias` says so."""

from __future__ import annotations

from typing import Any

from engine.layers.decoder_layers import DecoderSpec
from engine.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, qk_norm=True)
