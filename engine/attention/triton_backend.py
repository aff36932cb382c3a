"""The `triton` attention backend: the paged-attention and KV-write kernels of `kernels/`.

A step's batch is split into two launches, each with the kernel that suits it::

    tokens: | d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 |
            '-- decode ---' '------ prefill ------'
             paged_attention:  flash_prefill: FlashAttention-2 tiles
             1-token tiles,    (autotuned BLOCK_M x BLOCK_N, causal
             GQA rows packed,  tile skipping, unmasked full tiles)
             split-KV when
             the GPU is idle

Both launches write into one output tensor. A layer's sliding window, soft-cap and
attention sinks go to both. Before them, one launch per layer rotates q and k and writes the
step's keys and values into the cache (`forward_rotary`, kernels/rotary_kv.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata, AttentionParams


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels; needs a CUDA GPU (or `TRITON_INTERPRET=1`)."""

    name = "triton"
    # Its launches take device tensors; the decode launch's max_seq_len only bounds the
    # split-KV ranges (kernels/paged_attention.py), so max_model_len serves every step.
    supports_cuda_graphs = True

    def __init__(self, device: torch.device) -> None:
        try:
            import kernels
            from kernels._common import is_interpreter
        except ImportError as exc:  # triton is only a dependency on Linux x86_64
            raise RuntimeError(
                f"the triton attention backend needs the triton package ({exc}); "
                "use attention_backend='torch'"
            ) from exc
        on_cuda = device.type == "cuda" and torch.cuda.is_available()
        if not on_cuda and not is_interpreter():
            raise RuntimeError(
                "the triton attention backend needs a CUDA GPU; use attention_backend='torch'"
            )
        self.device = device
        self._kernels = kernels

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        self._kernels.write_kv_cache(key, value, kv_cache, slot_mapping)

    def forward_rotary(
        self,
        qk: torch.Tensor,  # [num_tokens, num_heads + num_kv_heads, head_dim], not yet rotated
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        rotate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]: (c | c)
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]: (-s | s)
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        params: AttentionParams,
        num_heads: int,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """One launch rotates q and k from the engine's cos/sin (every rope type) and writes
        the rotated keys and the values into the cache; the layer's `rotate` is not needed."""
        self._kernels.rotary_write_kv_cache(
            qk, value, cos, sin, kv_cache, metadata.slot_mapping, num_heads, **_scales(params)
        )
        return self.attend(qk[:, :num_heads], kv_cache, metadata, params)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        params: AttentionParams,
    ) -> torch.Tensor:
        """The write with the layer's FP8 scales (`write_kv` alone has none: 1.0), then
        `attend`."""
        self._kernels.write_kv_cache(key, value, kv_cache, metadata.slot_mapping, **_scales(params))
        return self.attend(query, kv_cache, metadata, params)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        params: AttentionParams,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        num_decodes, num_reqs = metadata.num_decodes, metadata.num_reqs
        if num_decodes > 0:
            # Decode requests come first with one token each: rows [0, num_decodes).
            self._kernels.paged_attention(
                query[:num_decodes],
                kv_cache,
                metadata.block_tables[:num_decodes],
                metadata.seq_lens[:num_decodes],
                metadata.query_start_loc[: num_decodes + 1],
                max_query_len=1,
                max_seq_len=max(metadata.seq_lens_cpu[:num_decodes]),
                scale=params.scale,
                out=out[:num_decodes],
                **params.kernel_options(),
                **_scales(params),
            )
        if num_reqs > num_decodes:
            # query_start_loc holds absolute rows, so the prefill slice needs no rebasing.
            self._kernels.flash_prefill(
                query,
                kv_cache,
                metadata.block_tables[num_decodes:num_reqs],
                metadata.seq_lens[num_decodes:num_reqs],
                metadata.query_start_loc[num_decodes : num_reqs + 1],
                max_query_len=metadata.max_query_len,
                scale=params.scale,
                out=out,
                **params.kernel_options(),
                **_scales(params),
            )
        return out


def _scales(params: AttentionParams) -> dict[str, float]:
    """An FP8 cache's per-tensor scales (ignored by the kernels for other caches)."""
    return {"k_scale": params.k_scale, "v_scale": params.v_scale}
