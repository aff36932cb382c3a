"""Multi-head latent attention's projections (DeepSeek-V2/V3, Kimi K2), around the paged
latent attention of engine/attention/mla.py.

Parameter names are the checkpoint's (transformers' `DeepseekV3Attention`)::

    q_a_proj [q_lora_rank, hidden] -> q_a_layernorm -> q_b_proj [H * (nope + rope), q_lora]
        (or one q_proj [H * (nope + rope), hidden] where q_lora_rank is None)
    kv_a_proj_with_mqa [kv_lora_rank + rope, hidden]  ->  c | k_pe
    kv_a_layernorm [kv_lora_rank]                        c's RMSNorm (before the cache)
    kv_b_proj [H * (nope + v), kv_lora_rank]             per head W_UK | W_UV
    o_proj [hidden, H * v]

What goes into the cache per token is `c | rotate(k_pe)`: kv_lora_rank + qk_rope_head_dim
values shared by all heads, against 2 * H * head_dim for full keys and values.

Rope acts on the last qk_rope_head_dim dims of each query head and on k_pe (one head).
DeepSeek's checkpoints lay those dims out as interleaved pairs (`rope_interleave`, true by
default); transformers rotates each pair (x[2i], x[2i+1]) and writes the results
de-interleaved, which is exactly the usual rotate-half rope applied to the de-interleaved
vector (x[0::2] | x[1::2]): the pairs are regrouped once and the model's rotary does the rest.

The softmax scale is (nope + rope) ** -0.5, times mscale ** 2 where the rope scaling has
`mscale_all_dim` (DeepSeek's YaRN), as transformers' `yarn_apply_mscale`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.mla import MLAWeights
from engine.config.rope import rope_parameters
from engine.layers.linear import Linear
from engine.layers.ops import OpImpl, RMSNorm
from engine.layers.rope import RotaryEmbedding

# transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default eps,
# not the config's rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(hf_config: Any) -> float:
    """(qk_nope_head_dim + qk_rope_head_dim) ** -0.5, with DeepSeek's YaRN mscale squared."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(hf_config)
    mscale_all_dim = params.scaling.get("mscale_all_dim", 0)
    if params.rope_type != "default" and mscale_all_dim:
        factor = float(params.scaling["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., d]
    """(x0, x1, x2, x3, ...) -> (x0, x2, ... | x1, x3, ...)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class MLAAttention(nn.Module):
    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, impl: OpImpl) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.num_heads = int(hf_config.num_attention_heads)
        self.num_kv_heads = 1  # one latent entry per token, shared by every head
        self.nope = int(hf_config.qk_nope_head_dim)
        self.rope = int(hf_config.qk_rope_head_dim)
        self.v_head_dim = int(hf_config.v_head_dim)
        self.kv_lora_rank = int(hf_config.kv_lora_rank)
        self.q_lora_rank = hf_config.q_lora_rank
        self.interleaved = bool(getattr(hf_config, "rope_interleave", True))
        self.sliding_window = None  # read by generic code: MLA attends to the whole context
        self.scale = mla_softmax_scale(hf_config)
        bias = bool(getattr(hf_config, "attention_bias", False))
        q_out = self.num_heads * (self.nope + self.rope)
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS, impl)
            self.q_b_proj = Linear(self.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS, impl)
        self.kv_b_proj = Linear(
            self.kv_lora_rank, self.num_heads * (self.nope + self.v_head_dim), bias=False
        )
        self.kv_b_proj.float_weight_only = True  # `_mla_weights` splits the float matrix
        self.o_proj = Linear(self.num_heads * self.v_head_dim, hidden, bias=bias)
        self.attn = attn_backend.mla_attention()
        self._weights: MLAWeights | None = None  # views of kv_b_proj.weight, built on first use

    def _mla_weights(self) -> MLAWeights:
        weight = self.kv_b_proj.weight
        cached = self._weights
        if cached is None or cached.kv_b.data_ptr() != weight.data_ptr():  # e.g. after a wake-up
            cached = MLAWeights.from_kv_b(weight, self.num_heads, self.nope, self.v_head_dim)
            self._weights = cached
        return cached

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden_size]
        rotary: RotaryEmbedding,
        cos: torch.Tensor,  # [T, 1, qk_rope_head_dim]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        num_tokens, num_heads, rank = hidden.shape[0], self.num_heads, self.kv_lora_rank
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, num_heads, self.nope + self.rope)  # [T, H, nope + rope]
        kv_a = self.kv_a_proj_with_mqa(hidden)  # [T, rank + rope]
        latent = self.kv_a_layernorm(kv_a[:, :rank].contiguous())  # [T, rank]
        q_pe, k_pe = q[:, :, self.nope :], kv_a[:, None, rank:]  # [T, H, rope], [T, 1, rope]
        if self.interleaved:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        pe = rotary.rotate_(torch.cat((q_pe, k_pe), dim=1), cos, sin)  # [T, H + 1, rope]
        entries = torch.cat((latent, pe[:, num_heads]), dim=-1)  # [T, rank + rope]
        out = self.attn(
            q[:, :, : self.nope],
            pe[:, :num_heads],
            entries,
            kv_cache,
            attn_metadata,
            self._mla_weights(),
            self.scale,
        )  # [T, H, v]
        return self.o_proj(out.reshape(num_tokens, num_heads * self.v_head_dim))
