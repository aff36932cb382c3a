"""Phi-3: the shared decoder; its checkpoint already stores the fused `qkv_proj` and
`gate_up_proj` tensors, so nothing is packed at load (an empty `packed_modules_mapping`)."""

from __future__ import annotations

from typing import Any, ClassVar

from engine.layers.decoder_layers import DecoderSpec
from engine.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = {}

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec()
