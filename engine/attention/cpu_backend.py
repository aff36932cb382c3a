"""The CPU default: native C kernels (engine/native/) composed into a split backend.

Decode requests (one query token each) go to `engine.native.paged_decode_attention`,
which reads keys and values from the paged cache in place instead of gathering each
request's context into a padded copy first; all prefill chunks of a step go to one
`engine.native.paged_prefill_attention` call (causal, flash-style online softmax over the
paged cache) instead of one SDPA call per request; the KV write is one native call. Both
kernels take the layer's sliding window, soft-cap and attention sinks. The kernels compute
in fp32: built for another model dtype, the backend composes the torch implementations
instead (decided once, at construction). The cache may be fp32, bf16 or fp16
(`kv_cache_dtype`): the kernels round keys/values into it when writing and widen them back
to fp32 when reading.
It also owns the batch-1 whole-step decode (cpu_decode_step.py). See engine/native/build.py
for how the kernels are built.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention.backend import AttentionMetadata, AttentionParams, SplitAttentionBackend
from engine.attention.cpu_decode_step import CPUDecodeStep
from engine.attention.torch_backend import GatherWorkspace, TorchDecode, TorchPrefill, scatter_kv
from engine.native import load_library, paged_decode_attention, paged_prefill_attention, write_kv


def native_write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """One native scatter where the rows have its layout (heads contiguous within a row,
    keys and values strided alike), else torch's."""
    if (
        key.stride(2) == 1
        and key.stride(1) == key.shape[2]
        and value.stride() == key.stride()
        and kv_cache.is_contiguous()
    ):
        write_kv(key, value, kv_cache, slot_mapping)
    else:
        scatter_kv(key, value, kv_cache, slot_mapping)


def native_decode(
    query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    params: AttentionParams,
) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
    num_decodes = query.shape[0]
    max_len = max(metadata.seq_lens_cpu[:num_decodes])
    return paged_decode_attention(
        query,
        kv_cache,
        metadata.block_tables,
        metadata.seq_lens,
        max_len,
        params.scale,
        **params.kernel_options(),
    )


def native_prefill(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], the prefill rows written
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    params: AttentionParams,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
) -> None:
    """One native call for all prefill chunks, reading the cache (this step's keys and
    values are already written) instead of one SDPA call per request."""
    paged_prefill_attention(
        out,
        query,
        kv_cache,
        metadata.block_tables,
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.num_decodes,
        params.scale,
        **params.kernel_options(),
    )


class CPUAttentionBackend(SplitAttentionBackend):
    name = "cpu"

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        load_library()  # raises NativeKernelError with the reason when it cannot build
        if dtype == torch.float32:
            super().__init__(native_write_kv, native_decode, native_prefill)
        else:
            workspace = GatherWorkspace()
            super().__init__(scatter_kv, TorchDecode(workspace), TorchPrefill(workspace))

    def whole_step_decode(self, model: Any) -> CPUDecodeStep | None:
        """Batch-1 decode through all layers in one native call (cpu_decode_step.py)."""
        return CPUDecodeStep.build(model)
