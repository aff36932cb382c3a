"""The Gemma family's text models, `Gemma2ForCausalLM` and `Gemma3ForCausalLM`: the shared
attention and gated MLP with Gemma's differences:

- embeddings scaled by sqrt(hidden_size) (in the model dtype, as transformers does);
- (1 + w) RMSNorms in fp32, a norm after attention and after the MLP as well as before;
- attention scale `query_pre_attn_scalar ** -0.5`;
- GeGLU (`gelu_pytorch_tanh`) MLP;
- layers alternating sliding-window and global attention (`layer_types`), each type with
  its own rope where the config gives one per type (`rope_parameters[layer_type]`, Gemma 3);
- optional final logit soft-capping.

Gemma 2 adds attention logit soft-capping (every backend applies it, after the scale and
before the mask); Gemma 3 replaces it with per-head q/k norms.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.layers.decoder_layers import (
    Attention,
    DecoderSpec,
    GatedMLP,
    get_head_dim,
    layer_sliding_windows,
)
from engine.layers.ops import GemmaRMSNorm, OpImpl
from engine.layers.parallel_layers import VocabParallelEmbedding
from engine.layers.rope import RotaryEmbedding, rope_parameters
from engine.models.decoder import DecoderForCausalLM

_LAYER_TYPES = ("sliding_attention", "full_attention")


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        spec: DecoderSpec,
        attn_backend: AttentionBackend,
        impl: OpImpl,
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        eps, hidden = hf_config.rms_norm_eps, hf_config.hidden_size
        self.self_attn = Attention(hf_config, spec, attn_backend, impl, sliding_window)
        self.mlp = GatedMLP(hf_config, spec, impl)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden_size], the residual stream
        rotary: RotaryEmbedding,
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        h = self.input_layernorm(hidden)
        h = self.self_attn(h, rotary, cos, sin, kv_cache, attn_metadata)
        hidden = hidden + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(h)


class GemmaModel(nn.Module):
    def __init__(
        self, hf_config: Any, spec: DecoderSpec, attn_backend: AttentionBackend, impl: OpImpl
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        # One stage holds every layer (Gemma does not split over ranks yet).
        self.start_layer, self.end_layer = 0, hf_config.num_hidden_layers
        self.is_first_stage = self.is_last_stage = True
        self.embed_scale = hf_config.hidden_size**0.5
        windows = layer_sliding_windows(hf_config)
        self.layer_types = [
            "sliding_attention" if window is not None else "full_attention" for window in windows
        ]
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(hf_config, spec, attn_backend, impl, window) for window in windows
        )
        self.norm = GemmaRMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.rotary = nn.ModuleDict(
            {
                layer_type: RotaryEmbedding.from_parameters(
                    get_head_dim(hf_config),
                    hf_config.max_position_embeddings,
                    rope_parameters(hf_config, layer_type),
                    impl,
                )
                for layer_type in _LAYER_TYPES
            }
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        hidden = self.embed_tokens(input_ids)  # [T, hidden_size]
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        cos_sin = {
            layer_type: rotary.cos_sin(positions, hidden.dtype, attn_metadata.rope_lengths)
            for layer_type, rotary in self.rotary.items()
        }  # per layer type: ([T, 1, head_dim], [T, 1, head_dim])
        for layer, layer_type, kv_cache in zip(
            self.layers, self.layer_types, kv_caches, strict=True
        ):
            cos, sin = cos_sin[layer_type]
            hidden = layer(hidden, self.rotary[layer_type], cos, sin, kv_cache, attn_metadata)
        return self.norm(hidden)


class Gemma2ForCausalLM(DecoderForCausalLM):
    model_class = GemmaModel
    supports_tensor_parallel = False
    supports_pipeline_parallel = False

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        cap = getattr(config, "attn_logit_softcapping", None)
        return DecoderSpec(
            qkv_bias=bias,
            o_bias=bias,
            gemma_norm=True,
            query_pre_attn_scalar=float(config.query_pre_attn_scalar),
            attn_logit_softcapping=None if cap is None else float(cap),
        )

    @classmethod
    def check_config(cls, config: Any) -> None:
        super().check_config(config)
        cap = getattr(config, "attn_logit_softcapping", None)
        if cap is not None and not float(cap) > 0:
            raise ValueError(f"attn_logit_softcapping must be > 0, got {cap}.")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V]
        logits = super().compute_logits(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def decode_layer_weights(self) -> None:
        return None  # the whole-step decode computes Llama-shaped layers only


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=True,
            gemma_norm=True,
            query_pre_attn_scalar=float(config.query_pre_attn_scalar),
        )

    @classmethod
    def check_config(cls, config: Any) -> None:
        super().check_config(config)
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise NotImplementedError(
                "attention logit soft-capping with Gemma 3 (attn_logit_softcapping) is not "
                "supported."
            )
        if getattr(config, "use_bidirectional_attention", False):
            raise NotImplementedError("use_bidirectional_attention is not supported.")
