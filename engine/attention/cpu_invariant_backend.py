"""The batch-invariant CPU backend (EngineArgs `batch_invariant`, docs/determinism.md).

The `cpu` backend computes a decode row with one kernel (three passes over the whole
context, split into several key ranges when the batch is too small to keep every thread
busy) and a prefill row with another (an online softmax over 256-key segments, rows of a
tile paired over the values), so the bits of a token's attention depend on whether it was
decoded or prefilled, on the batch size and on the chunk the row sat in. Here every row,
decode rows included (as one-token chunks), goes through the prefill kernel's invariant
variant: segments at fixed key positions, one value pass per row, no split of a row over
threads. A token then has the same attention output alone, in any batch, in a full or a
chunked prefill, after a prefix-cache hit or a preemption, or decoded on another replica
after a migration. There is no whole-step decode (its linears and attention are the
batch-variant ones).

    rows:  [ d0 | d1 | p0 p0 p0 | p1 p1 ]   decodes first, then prefill chunks
    here:   one paged_prefill_attention_invariant call over all of them (first_req 0)
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention.backend import AttentionMetadata, AttentionParams, SplitAttentionBackend
from engine.attention.cpu_backend import native_write_kv
from engine.native import load_library, paged_prefill_attention


def _no_split(*args: Any) -> Any:
    raise AssertionError("the batch-invariant backend attends to all rows in one call")


class CPUBatchInvariantAttentionBackend(SplitAttentionBackend):
    # The op implementations follow the backend's name (engine/layers/ops.py): the native
    # per-row kernels of `cpu` (RMSNorm, rotary, SiLU-and-mul are already row-invariant).
    name = "cpu"
    batch_invariant = True

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        if dtype != torch.float32:
            raise ValueError(
                f"batch_invariant on the CPU computes in float32, not {dtype} (dtype='float32')."
            )
        load_library()  # raises NativeKernelError with the reason when it cannot build
        super().__init__(native_write_kv, _no_split, _no_split)

    def _attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        params: AttentionParams,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        out = query.new_empty(query.shape)
        paged_prefill_attention(
            out,
            query,
            kv_cache,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            0,  # every request, decodes as one-token chunks
            params.scale,
            batch_invariant=True,
            **params.kernel_options(),
        )
        return out

    def whole_step_decode(self, model: Any) -> None:
        return None
