"""The CPU default: the torch backend with decode attention in native kernels.

Decode requests (one query token each) go to `engine.native.paged_decode_attention`,
which reads keys and values from the paged cache in place instead of gathering each
request's context into a padded copy first; all prefill chunks of a step go to one
`engine.native.paged_prefill_attention` call (causal, flash-style online softmax over the
paged cache) instead of one SDPA call per request; the KV write is one native call.
Dtypes other than fp32 take the torch backend's paths. See
engine/native/build.py for how the kernels are built.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention.backend import AttentionMetadata
from engine.attention.cpu_decode_step import CPUDecodeStep
from engine.attention.torch_backend import TorchAttentionBackend
from engine.native import load_library, paged_decode_attention, paged_prefill_attention, write_kv


class CPUAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        load_library()  # raises NativeKernelError with the reason when it cannot build

    def whole_step_decode(self, model: Any) -> CPUDecodeStep | None:
        """Batch-1 decode through all layers in one native call (cpu_decode_step.py)."""
        return CPUDecodeStep.build(model)

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding (skipped natively)
    ) -> None:
        if _native_layout(key, value, kv_cache):
            write_kv(key, value, kv_cache, slot_mapping)
        else:
            super().write_kv(key, value, kv_cache, slot_mapping)

    def _write_valid_kv(
        self,
        key: torch.Tensor,  # [n, num_kv_heads, head_dim]
        value: torch.Tensor,  # [n, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [n] int64, all >= 0
    ) -> None:
        # The native write needs no padding-free fast path: it skips -1 slots itself.
        self.write_kv(key, value, kv_cache, slot_mapping)

    def _prefill(
        self,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim], the prefill rows written
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
    ) -> None:
        if query.dtype != torch.float32 or kv_cache.dtype != torch.float32:
            super()._prefill(out, query, kv_cache, metadata, scale, key, value)
            return
        # One native call for all prefill chunks, reading the cache (this step's keys and
        # values are already written) instead of one SDPA call per request.
        paged_prefill_attention(
            out,
            query,
            kv_cache,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.num_decodes,
            scale,
        )

    def _decode(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
        if query.dtype != torch.float32 or query.device.type != "cpu":
            return super()._decode(query, kv_cache, metadata, scale)
        num_decodes = query.shape[0]
        max_len = max(metadata.seq_lens_cpu[:num_decodes])
        return paged_decode_attention(
            query,
            kv_cache,
            metadata.block_tables,
            metadata.seq_lens,
            max_len,
            scale,
        )


def _native_layout(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """fp32 on the CPU, heads contiguous within a row: what the native KV write takes."""
    return (
        key.dtype == torch.float32
        and kv_cache.dtype == torch.float32
        and key.device.type == "cpu"
        and key.stride(2) == 1
        and key.stride(1) == key.shape[2]
        and value.stride() == key.stride()
        and kv_cache.is_contiguous()
    )
