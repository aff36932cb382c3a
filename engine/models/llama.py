"""Llama family (Llama 2/3, SmolLM2) and Mistral (with its sliding window): the shared
decoder with optional attention and MLP biases."""

from __future__ import annotations

from typing import Any

from engine.layers.decoder_layers import (  # noqa: F401 - re-exported helpers
    DecoderSpec,
    get_head_dim,
    get_kv_cache_shape,
    kv_cache_bytes_per_token,
)
from engine.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral's layers are Llama's; `sliding_window` (when set) limits every layer's
    attention, enforced by the attention backends and used by the KV-cache manager."""
