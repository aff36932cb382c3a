"""The decoder-only causal LM every dense family builds on: embedding, a stack of
`DecoderLayer`s, final norm, logits; weights through the generic loader.

A family is a subclass that sets its `DecoderSpec` from the config (and, where its
checkpoint differs, `packed_modules_mapping`): see llama.py, qwen2.py, qwen3.py, phi3.py.
`forward` returns final-norm hidden states; `compute_logits` projects the chosen rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.models.layers import (
    DecoderLayer,
    DecoderSpec,
    GatedMLP,
    get_head_dim,
    layer_sliding_windows,
)
from engine.models.linear import (
    Linear,
    linear,
    pack_linear_weights,
    pack_weight,
    packing_available,
)
from engine.models.ops import OpImpl, RMSNorm, RotaryEmbedding
from engine.models.rope import rope_parameters
from engine.models.weight_loader import load_weights


class DecoderModel(nn.Module):
    def __init__(
        self, hf_config: Any, spec: DecoderSpec, attn_backend: AttentionBackend, impl: OpImpl
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, spec, attn_backend, impl, window, layer_idx)
            for layer_idx, window in enumerate(layer_sliding_windows(hf_config))
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, impl)
        self.rotary_emb = RotaryEmbedding.from_parameters(
            get_head_dim(hf_config),
            hf_config.max_position_embeddings,
            rope_parameters(hf_config),
            impl,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        hidden = self.embed_tokens(input_ids)  # [T, hidden_size]
        cos, sin = self.rotary_emb.cos_sin(positions, hidden.dtype)  # [T, 1, head_dim] each
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(
                hidden, residual, self.rotary_emb, cos, sin, kv_cache, attn_metadata
            )
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """Base of the dense families; subclasses set `decoder_spec` (and the mapping)."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    model_class: ClassVar[type[nn.Module]] = DecoderModel  # the layer stack
    # Checkpoint tensors we compute instead of loading (old checkpoints store inv_freq).
    ignored_weight_suffixes: ClassVar[tuple[str, ...]] = (".rotary_emb.",)
    # Mixture-of-experts families: per-expert checkpoint modules -> stacked parameters
    # (engine.models.weight_loader), and renames applied to checkpoint names first.
    expert_weights_mapping: ClassVar[dict[str, tuple[str, int | None]] | None] = None
    weight_name_substitutions: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(
        self, config: Any, attn_backend: AttentionBackend, op_impl: OpImpl = "torch"
    ) -> None:
        super().__init__()
        self.config = config
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = get_head_dim(config)
        self.op_impl = op_impl
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = self.model_class(config, self.decoder_spec(config), attn_backend, op_impl)
        self.lm_head = (
            None
            if self.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self._packed_logits_weight: torch.Tensor | None = None  # set by pack_weights
        self.quantized_logits: Any = None  # set by engine.models.quantization

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        raise NotImplementedError

    @classmethod
    def check_config(cls, config: Any) -> None:
        """Raises NotImplementedError for settings the family's code does not implement."""
        layer_sliding_windows(config)  # rejects unknown layer types

    @classmethod
    def kv_cache_sliding_window(cls, config: Any) -> int | None:
        """The window the KV-cache manager may free blocks behind: set only when every
        layer uses the same one (a full-attention layer needs every block)."""
        windows = set(layer_sliding_windows(config))
        return windows.pop() if len(windows) == 1 else None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        if self.quantized_logits is not None:  # LM head kept quantized (models/quantization.py)
            return self.quantized_logits.apply(hidden, None)
        return linear(hidden, self._logits_weight, None, self._packed_logits_weight).float()

    @property
    def _logits_weight(self) -> torch.Tensor:  # [vocab_size, hidden_size]
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_weights(self) -> int:
        """Packs the projection weights for MKL's fp32 CPU GEMM (see `engine.models.linear`);
        call after loading. Returns the number of packed matrices (0 where not applicable)."""
        num_packed = pack_linear_weights(self)
        if not num_packed or self.quantized_logits is not None:
            return num_packed
        if self.lm_head is not None:
            self._packed_logits_weight = self.lm_head.packed_weight
        elif packing_available():  # the tied embedding is not a Linear
            self._packed_logits_weight = pack_weight(self._logits_weight)
            num_packed += 1
        return num_packed

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face-named tensors into the (fused) parameters (`weight_loader`)."""
        ignored = self.ignored_weight_suffixes
        if self.lm_head is None:
            ignored = (*ignored, "lm_head.weight")  # some tied checkpoints keep a copy
        load_weights(
            self,
            weights,
            self.packed_modules_mapping,
            ignored,
            self.expert_weights_mapping,
            self.weight_name_substitutions,
        )

    def decode_layer_weights(self) -> list[dict[str, Any]] | None:
        """Each layer's tensors by role, and its projection `Linear`s (which may hold
        quantized weights), for a whole-step decode outside the modules (the `cpu`
        backend's, engine/attention/cpu_decode_step.py); None where a layer does more
        than that path computes (per-head q/k norms)."""
        layers = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.q_norm is not None or not isinstance(mlp, GatedMLP):
                return None  # q/k norms or experts: not what the whole-step path computes
            layers.append(
                {
                    "input_norm": layer.input_layernorm.weight,
                    "qkv_weight": attn.qkv_proj.weight,
                    "qkv_bias": attn.qkv_proj.bias,
                    "o_weight": attn.o_proj.weight,
                    "o_bias": attn.o_proj.bias,
                    "post_norm": layer.post_attention_layernorm.weight,
                    "gate_up_weight": mlp.gate_up_proj.weight,
                    "gate_up_bias": mlp.gate_up_proj.bias,
                    "down_weight": mlp.down_proj.weight,
                    "down_bias": mlp.down_proj.bias,
                    "qkv": attn.qkv_proj,
                    "o": attn.o_proj,
                    "gate_up": mlp.gate_up_proj,
                    "down": mlp.down_proj,
                }
            )
        return layers
