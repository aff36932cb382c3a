"""Qwen2 / Qwen2.5: the shared decoder with biases on q, k and v (not on o), tied or untied
embeddings, rope scaling as configured."""

from __future__ import annotations

from typing import Any

from engine.layers.decoder_layers import DecoderSpec
from engine.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True)
