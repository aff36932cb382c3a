"""Layers shared by the decoder-only families: attention (fused QKV, optional per-head
q/k RMSNorm, rotary, the backend call), the gated MLP and the pre-norm decoder layer that
every family builds its stack of (DeepSeek-V3's too: its spec picks multi-head latent
attention, engine/layers/mla.py, and its experts).

Parameter names mirror Hugging Face's except for two fusions that cut the number of ops
per layer (which dominates on CPU); each fused `Linear` records its shards' sizes in
`output_sizes`, which the generic loader (`engine.loader.weight_loader`) reads::

    q_proj | k_proj | v_proj  ->  self_attn.qkv_proj   [(H + 2 * Hkv) * D, hidden]
    gate_proj | up_proj       ->  mlp.gate_up_proj     [2 * intermediate, hidden]

Every op's implementation (torch / native C / Triton) is the `impl` given at construction
(`engine.layers.ops.select_op_impl`); nothing here tests the device or the backend.

Under tensor parallelism each rank builds its share (engine/distributed/sharding.py): its
heads in `qkv_proj` and `o_proj`, its slice of the intermediate dimension in
`gate_up_proj` and `down_proj`; `o_proj` and `down_proj` sum over the ranks
(engine/layers/parallel_layers.py). In a world of one these are the plain layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata, AttentionParams
from engine.distributed.parallel_state import get_parallel_rank
from engine.distributed.sharding import RowSlice, partition_heads, split_evenly
from engine.layers.mla import MLAAttention
from engine.layers.moe import MoESpec
from engine.layers.ops import (
    GeluTanhAndMul,
    GemmaRMSNorm,
    OpImpl,
    RMSNorm,
    SiluAndMul,
)
from engine.layers.parallel_layers import RowParallelLinear, column_parallel_linear
from engine.layers.rope import RotaryEmbedding


def get_head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )


def get_kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int]:
    """The per-layer cache shape: [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def kv_cache_bytes_per_token(hf_config: Any, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take over all layers."""
    element_size = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * hf_config.num_key_value_heads * get_head_dim(hf_config) * element_size
    return per_layer * hf_config.num_hidden_layers


@dataclass(frozen=True)
class DecoderSpec:
    """What distinguishes one family's decoder layer from another's (read from its config)."""

    qkv_bias: bool = False  # Qwen2: biases on q/k/v only
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before the rotation
    gemma_norm: bool = False  # Gemma: x / rms(x) * (1 + w), in fp32
    query_pre_attn_scalar: float | None = None  # Gemma: scale = this ** -0.5, not head_dim's
    attn_logit_softcapping: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    moe: MoESpec | None = None  # Mixtral, Qwen3-MoE, GPT-OSS: experts instead of the gated MLP
    attention_sinks: bool = False  # GPT-OSS: a learned logit per head in the softmax's sum
    # DeepSeek-V3: multi-head latent attention (engine/layers/mla.py, a latent KV cache)
    # instead of `Attention`.
    mla: bool = False


def make_norm(hidden_size: int, eps: float, spec: DecoderSpec, impl: OpImpl) -> nn.Module:
    """The family's RMSNorm (Gemma's (1 + w) variant is torch-only)."""
    return GemmaRMSNorm(hidden_size, eps) if spec.gemma_norm else RMSNorm(hidden_size, eps, impl)


def layer_sliding_windows(hf_config: Any) -> list[int | None]:
    """Each layer's sliding window (None: full attention), from `layer_types` where the
    config has them (transformers 5: "sliding_attention" / "full_attention"), else the
    config's `sliding_window` for every layer unless `use_sliding_window` is false."""
    window = getattr(hf_config, "sliding_window", None)
    num_layers = hf_config.num_hidden_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise NotImplementedError(f"layer_types {sorted(unknown)} are not supported.")
        return [window if t == "sliding_attention" else None for t in layer_types]
    if window is None or getattr(hf_config, "use_sliding_window", True) is False:
        return [None] * num_layers
    return [int(window)] * num_layers


class Attention(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        spec: DecoderSpec,
        attn_backend: AttentionBackend,
        impl: OpImpl,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = hf_config.num_key_value_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}."
            )
        self.head_dim = get_head_dim(hf_config)
        self.scale = (spec.query_pre_attn_scalar or self.head_dim) ** -0.5
        # An FP8 KV cache's per-tensor scales: the checkpoint's (set by the loader), else 1.0.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.logits_soft_cap = spec.attn_logit_softcapping
        self.attn_backend = attn_backend
        ranks = get_parallel_rank()
        part = partition_heads(self.num_heads, self.num_kv_heads, ranks.tp_rank, ranks.tp_size)
        self.num_heads, self.num_kv_heads = part.num_heads, part.num_kv_heads  # this rank's
        head_dim = self.head_dim
        num_heads_total = hf_config.num_attention_heads
        num_kv_total = hf_config.num_key_value_heads
        self.qkv_proj = column_parallel_linear(
            hf_config.hidden_size,
            (
                RowSlice(
                    part.head_start * head_dim,
                    part.num_heads * head_dim,
                    num_heads_total * head_dim,
                ),
                RowSlice(
                    part.kv_head_start * head_dim,
                    part.num_kv_heads * head_dim,
                    num_kv_total * head_dim,
                ),
                RowSlice(
                    part.kv_head_start * head_dim,
                    part.num_kv_heads * head_dim,
                    num_kv_total * head_dim,
                ),
            ),
            bias=spec.qkv_bias,
        )
        self.o_proj = RowParallelLinear(
            num_heads_total * head_dim, hf_config.hidden_size, bias=spec.o_bias
        )
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if spec.qk_norm:
            self.q_norm = make_norm(self.head_dim, hf_config.rms_norm_eps, spec, impl)
            self.k_norm = make_norm(self.head_dim, hf_config.rms_norm_eps, spec, impl)
        # [num_heads] (this rank's heads), named as the checkpoint's `self_attn.sinks`.
        self.sinks: nn.Parameter | None = None
        if spec.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        rotary: RotaryEmbedding,
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens, num_heads, head_dim = hidden.shape[0], self.num_heads, self.head_dim
        num_qk_heads = num_heads + self.num_kv_heads
        qkv = self.qkv_proj(hidden).view(num_tokens, -1, head_dim)  # [T, H + 2 Hkv, D]
        value = qkv[:, num_qk_heads:]  # [T, Hkv, D]
        if self.q_norm is None or self.k_norm is None:
            # q and k are adjacent heads of qkv: one rotation covers both (in place natively).
            qk = qkv[:, :num_qk_heads]  # [T, H + Hkv, D]
        else:
            q = self.q_norm(qkv[:, :num_heads].reshape(-1, head_dim))  # [T * H, D]
            k = self.k_norm(qkv[:, num_heads:num_qk_heads].reshape(-1, head_dim))
            qk = torch.cat(
                (q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, -1, head_dim)), 1
            )
        params = AttentionParams(
            self.scale,
            self.sliding_window,
            self.logits_soft_cap,
            self.sinks,
            self.k_scale,
            self.v_scale,
        )
        # The backend rotates q and k (with the rotary's own op, or fused with its KV write).
        out = self.attn_backend.forward_rotary(
            qk, value, rotary.rotate_, cos, sin, kv_cache, attn_metadata, params, num_heads
        )
        return self.o_proj(out.reshape(num_tokens, num_heads * head_dim))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one GEMM."""

    def __init__(self, hf_config: Any, spec: DecoderSpec, impl: OpImpl) -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_activation", None) or getattr(
            hf_config, "hidden_act", "silu"
        )
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise NotImplementedError(
                f"hidden_act={act!r} is not supported (silu, gelu_pytorch_tanh)."
            )
        hidden, intermediate = hf_config.hidden_size, hf_config.intermediate_size
        ranks = get_parallel_rank()
        rows = split_evenly(intermediate, ranks.tp_size, ranks.tp_rank)
        self.intermediate_size = rows.size  # this rank's slice
        self.gate_up_proj = column_parallel_linear(hidden, (rows, rows), bias=spec.mlp_bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=spec.mlp_bias)
        self.act_fn: nn.Module = SiluAndMul(impl) if act == "silu" else GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # via [T, intermediate]


def build_attention(
    hf_config: Any,
    spec: DecoderSpec,
    attn_backend: AttentionBackend,
    impl: OpImpl,
    sliding_window: int | None,
) -> nn.Module:
    """The layer's attention: multi-head latent attention where the spec says so, else
    `Attention` (both take the same forward arguments)."""
    if spec.mla:
        return MLAAttention(hf_config, attn_backend, impl)
    return Attention(hf_config, spec, attn_backend, impl, sliding_window)


class DecoderLayer(nn.Module):
    """Pre-norm layer: x + attn(norm(x)), then + mlp(norm(.)); the adds are fused into the
    next norm (which takes the residual stream as its second input). Every family's layer:
    the spec picks the attention (`build_attention`) and the MLP (gated, or its `moe`'s
    layer outside `moe.dense_layers`)."""

    def __init__(
        self,
        hf_config: Any,
        spec: DecoderSpec,
        attn_backend: AttentionBackend,
        impl: OpImpl,
        sliding_window: int | None = None,
        layer_idx: int = 0,
    ) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.self_attn = build_attention(hf_config, spec, attn_backend, impl, sliding_window)
        self.mlp: nn.Module
        if spec.moe is not None and layer_idx not in spec.moe.dense_layers:
            self.mlp = spec.moe.build(hf_config, impl)  # the spec's own MoE layer
        else:
            self.mlp = GatedMLP(hf_config, spec, impl)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, impl)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, impl)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden_size]
        residual: torch.Tensor | None,  # [T, hidden_size]; None before the first layer
        rotary: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (MLP output, residual stream before it); the next norm adds the two."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, cos, sin, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
