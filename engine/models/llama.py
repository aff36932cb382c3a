"""Llama-family causal LM (Llama 2/3, SmolLM2, Mistral without sliding window) over the paged cache.

Our own module tree; parameter names mirror Hugging Face's except for two fusions that cut
the number of ops per layer (which dominates on CPU)::

    q_proj | k_proj | v_proj  ->  self_attn.qkv_proj   [(H + 2 * Hkv) * D, hidden]
    gate_proj | up_proj       ->  mlp.gate_up_proj     [2 * intermediate, hidden]

`load_weights` takes Hugging Face names and fills the fused parameters shard by shard.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine import native
from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.models.linear import Linear, linear, pack_linear_weights, pack_weight
from engine.models.ops import RotaryEmbedding, apply_rotary_emb_, rms_norm, silu_and_mul

# Hugging Face projection name -> (our fused parameter's module, shard).
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def get_kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int]:
    """The per-layer cache shape: [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def get_head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )


def kv_cache_bytes_per_token(hf_config: Any, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take over all layers."""
    element_size = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * hf_config.num_key_value_heads * get_head_dim(hf_config) * element_size
    return per_layer * hf_config.num_hidden_layers


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    """transformers 5 keeps rope_theta and the scaling in `rope_parameters`."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if not params and legacy:
        params = dict(legacy)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    def __init__(self, hf_config: Any, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = hf_config.num_key_value_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}."
            )
        self.head_dim = get_head_dim(hf_config)
        self.scale = self.head_dim**-0.5
        self.attn_backend = attn_backend
        bias = bool(getattr(hf_config, "attention_bias", False))
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(hf_config.hidden_size, qkv_size, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hf_config.hidden_size, bias=bias)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(hidden).view(num_tokens, -1, self.head_dim)  # [T, H + 2 Hkv, D]
        # q and k are adjacent heads of qkv, so one rotation covers both (in place on CPU).
        qk = apply_rotary_emb_(qkv[:, :num_qk_heads], cos, sin)  # [T, H + Hkv, D]
        query = qk[:, : self.num_heads]  # [T, H, D]
        key = qk[:, self.num_heads :]  # [T, Hkv, D]
        value = qkv[:, num_qk_heads:]  # [T, Hkv, D]
        out = self.attn_backend.forward(query, key, value, kv_cache, attn_metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        bias = bool(getattr(hf_config, "mlp_bias", False))
        hidden, intermediate = hf_config.hidden_size, hf_config.intermediate_size
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # via [T, intermediate]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, attn_backend: AttentionBackend) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.self_attn = LlamaAttention(hf_config, attn_backend)
        self.mlp = LlamaMLP(hf_config)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden_size]
        residual: torch.Tensor | None,  # [T, hidden_size]; None before the first layer
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
        hidden = self.self_attn(hidden, cos, sin, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, hf_config: Any, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, attn_backend) for _ in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self._intermediate_size = hf_config.intermediate_size  # for _native_decode
        self._layer_table: tuple[Any, ...] | None = None  # see _native_layer_table
        rope = _rope_parameters(hf_config)
        self.rotary_emb = RotaryEmbedding(
            get_head_dim(hf_config),
            hf_config.max_position_embeddings,
            rope["rope_theta"],
            rope,
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
        if self._takes_native_decode(hidden, attn_metadata):
            return self._native_decode(hidden, cos, sin, kv_caches, attn_metadata)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _takes_native_decode(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """Batch-1 decode on the CPU in fp32 with the `cpu` attention backend (so the cache
        layout is the native kernels'): all layers in one native call (see below)."""
        return (
            hidden.shape[0] == 1
            and metadata.num_decodes == 1
            and len(metadata.seq_lens_cpu) == 1
            and hidden.dtype == torch.float32
            and hidden.device.type == "cpu"
            and self.layers[0].self_attn.attn_backend.name == "cpu"
        )

    def _native_decode(
        self,
        hidden: torch.Tensor,  # [1, hidden_size], the embedding
        cos: torch.Tensor,  # [1, 1, head_dim]
        sin: torch.Tensor,  # [1, 1, head_dim]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [1, hidden_size]
        """One decode token through every layer in one native call (engine.native
        `decode_token`). A batch-1 step is bound by streaming the weights; per layer the
        modules' dozen ops (each a Python call, a dispatch and a thread-pool wake-up) cost
        about as much again, and that is what this path removes. Same math as the modules
        (GEMVs on the unpacked weights, summed in a different order)."""
        attn = self.layers[0].self_attn
        hidden = hidden.reshape(-1).clone()  # [hidden_size], overwritten in place
        residual = native.decode_token(
            hidden,
            self._native_layer_table(kv_caches),
            cos.reshape(-1),
            sin.reshape(-1),
            metadata.block_tables[0],
            metadata.seq_lens_cpu[0],
            int(metadata.slot_mapping[0]),
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            self._intermediate_size,
            kv_caches[0].shape[2],
            self.norm.eps,
            attn.scale,
        )
        hidden, _ = self.norm(hidden[None], residual[None])
        return hidden

    def _native_layer_table(self, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """[num_layers, fields] int64 addresses of each layer's weights and caches, built
        once per set of caches (the weights do not move after loading)."""
        key = (len(kv_caches), kv_caches[0].data_ptr(), kv_caches[-1].data_ptr())
        if self._layer_table is not None and self._layer_table[0] == key:
            return self._layer_table[1]

        def address(t: torch.Tensor | None) -> int:
            if t is None:
                return 0
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("native decode needs contiguous fp32 CPU weights and caches")
            return t.data_ptr()

        rows = []
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            fields = {
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
                "key_cache": cache[0],
                "value_cache": cache[1],
            }
            rows.append([address(fields[name]) for name in native.DECODE_LAYER_FIELDS])
        table = torch.tensor(rows, dtype=torch.int64)
        # The table holds raw addresses: keep the caches it points into alive with it.
        self._layer_table = (key, table, list(kv_caches))
        return table


class LlamaForCausalLM(nn.Module):
    """`forward` returns final-norm hidden states; `compute_logits` projects chosen rows."""

    def __init__(self, config: Any, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = get_head_dim(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = LlamaModel(config, attn_backend)
        self.lm_head = (
            None
            if self.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self._packed_logits_weight: torch.Tensor | None = None  # set by pack_weights

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        return linear(hidden, self._logits_weight, None, self._packed_logits_weight).float()

    @property
    def _logits_weight(self) -> torch.Tensor:  # [vocab_size, hidden_size]
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_weights(self) -> int:
        """Packs the projection weights for MKL's fp32 CPU GEMM (see `engine.models.linear`);
        call after loading. Returns the number of packed matrices (0 where not applicable)."""
        num_packed = pack_linear_weights(self)
        if not num_packed:
            return 0
        if self.lm_head is not None:
            self._packed_logits_weight = self.lm_head.packed_weight
        else:  # the tied embedding is not a Linear
            self._packed_logits_weight = pack_weight(self._logits_weight)
            num_packed += 1
        return num_packed

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face-named tensors into the (fused) parameters; checks every name."""
        params = dict(self.named_parameters())
        shards = self._fused_shards()
        pending = {(name, shard) for name, shard_map in shards.items() for shard in shard_map}
        pending |= {(name, None) for name in params if name not in shards}
        for hf_name, tensor in weights:
            if "rotary_emb." in hf_name:  # old checkpoints store inv_freq; we compute it
                continue
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue  # some tied checkpoints keep a copy of the embedding
            name, shard = self._param_name(hf_name)
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {type(self).__name__}.")
            target = params[name].data
            if shard is not None:
                start, size = shards[name][shard]
                target = target.narrow(0, start, size)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}."
                )
            with torch.no_grad():
                target.copy_(tensor)
            pending.discard((name, shard))
        if pending:
            missing = sorted(f"{name}[{shard}]" if shard else name for name, shard in pending)
            raise ValueError(f"missing weights: {', '.join(missing[:8])} ({len(missing)} in all).")

    def _param_name(self, hf_name: str) -> tuple[str, str | None]:
        """HF name -> (our parameter name, shard or None)."""
        parts = hf_name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED_SHARDS:
            fused, shard = _FUSED_SHARDS[parts[-2]]
            return ".".join([*parts[:-2], fused, parts[-1]]), shard
        return hf_name, None

    def _fused_shards(self) -> dict[str, dict[str, tuple[int, int]]]:
        """Our fused parameter name -> {shard: (row offset, rows)}."""
        cfg = self.config
        q_size = cfg.num_attention_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        inter = cfg.intermediate_size
        qkv = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        gate_up = {"gate": (0, inter), "up": (inter, inter)}
        shards: dict[str, dict[str, tuple[int, int]]] = {}
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                shards[name] = qkv
            elif ".gate_up_proj." in name:
                shards[name] = gate_up
        return shards
