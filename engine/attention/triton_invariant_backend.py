"""The batch-invariant Triton backend (EngineArgs `batch_invariant`, docs/determinism.md).

The `triton` backend attends decode rows with `paged_attention` (split-KV when the batch is
small) and prefill chunks with `flash_prefill` (autotuned tiles), so a token's attention has
other bits decoded than prefilled, and in one batch than in another. Here every row, decode
rows included (as one-token chunks), goes through one launch of `invariant_attention`
(kernels/batch_invariant_attention.py): one program per (row, head), 64-key steps at fixed
positions, no split, no autotune. The rotation and KV write stay the `triton` backend's
fused per-row kernel, and its ops (RMSNorm, SiLU-and-mul: one program per row) are unchanged;
the linears go on the invariant matmul (engine/layers/batch_invariant/triton_linear.py,
applied by the loader). The CPU twin is engine/attention/cpu_invariant_backend.py.

    rows:  [ d0 | d1 | p0 p0 p0 | p1 p1 ]   decodes first, then prefill chunks
    here:   one invariant_attention launch over all of them

CUDA graphs: the launch reads device tensors only (its grid is the padded batch's shape), and
the padding rows are programs of their own that touch no real row.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionMetadata, AttentionParams
from engine.attention.triton_backend import TritonAttentionBackend


class TritonBatchInvariantAttentionBackend(TritonAttentionBackend):
    # The op implementations follow the backend's name (engine/layers/ops.py): triton's.
    name = "triton"
    batch_invariant = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        from kernels.batch_invariant_attention import invariant_attention

        self._invariant_attention = invariant_attention

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        params: AttentionParams,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        num_reqs = metadata.num_reqs
        self._invariant_attention(
            query,
            kv_cache,
            metadata.block_tables[:num_reqs],
            metadata.seq_lens[:num_reqs],
            metadata.query_start_loc[: num_reqs + 1],
            scale=params.scale,
            out=out,
            **params.kernel_options(),
        )
        return out
