"""Pure-torch paged attention: runs on any device, the CPU default.

Decode requests are attended together: their blocks are gathered into one padded batch and
one masked SDPA call covers them all. Prefill chunks go one request at a time, each with a
causal mask shifted by its cached context (query token i sits at absolute position
seq_len - query_len + i)::

    keys:     0 1 2 3 4 5      seq_len = 6, query_len = 2, cached = 4
    query 0:  x x x x x .      sees keys j <= cached + 0
    query 1:  x x x x x x      sees keys j <= cached + 1

Loop bounds come from the metadata's host lists, so nothing syncs with the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._workspace = _Workspace()

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding
    ) -> None:
        """Scatters keys and values into the cache, skipping -1 slots."""
        valid = slot_mapping >= 0  # [num_tokens] bool
        index = valid.nonzero().squeeze(1)  # [num_valid]
        _scatter_kv(key[index], value[index], kv_cache, slot_mapping[index])

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        # Padding tokens come after the real ones, so the valid slots are a prefix: slicing
        # avoids the mask `write_kv` needs for an arbitrary slot_mapping.
        n = metadata.num_actual_tokens
        _scatter_kv(key[:n], value[:n], kv_cache, metadata.slot_mapping[:n])
        return self._attend(query, kv_cache, metadata, scale, key, value)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        return self._attend(query, kv_cache, metadata, scale, None, None)

    def _attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim], this step's keys
        value: torch.Tensor | None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        num_tokens = query.shape[0]
        num_decodes = metadata.num_decodes
        num_reqs = metadata.num_reqs
        query_start_loc = metadata.query_start_loc_cpu
        if num_reqs == 1 and num_tokens == query_start_loc[1]:
            # One request filling the whole batch (batch-1 decode, a lone prefill): no copy.
            if num_decodes == 1:
                return _decode(query, kv_cache, metadata, scale, self._workspace)
            return _prefill_one(query, kv_cache, metadata, scale, 0, key, value, self._workspace)

        out = query.new_empty(query.shape)  # [num_tokens, num_heads, head_dim]
        if num_decodes > 0:
            decode_query = query[:num_decodes]  # [num_decodes, num_heads, head_dim]
            out[:num_decodes] = _decode(decode_query, kv_cache, metadata, scale, self._workspace)
        for i in range(num_decodes, num_reqs):
            start, end = query_start_loc[i], query_start_loc[i + 1]
            out[start:end] = _prefill_one(
                query[start:end], kv_cache, metadata, scale, i, key, value, self._workspace
            )
        if query_start_loc[num_reqs] < num_tokens:
            out[query_start_loc[num_reqs] :].zero_()  # padding rows
        return out


def _scatter_kv(
    key: torch.Tensor,  # [n, num_kv_heads, head_dim]
    value: torch.Tensor,  # [n, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [n] int64, all >= 0
) -> None:
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)  # [2, slots, Hkv, D]
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


class _Workspace:
    """A reused buffer for gathered keys/values.

    Gathering a long context makes a large tensor every layer; a fresh one of that size is
    served by mmap and page-faulted in each time, which costs several times the copy itself
    on CPU. One layer's gathered blocks are dead before the next layer runs, so one buffer
    serves every layer and every request of a step.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def gather_kv(
        self,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
        seq_len: int,
    ) -> torch.Tensor:  # [2, num_reqs, num_kv_heads, seq_len, head_dim]
        """Each request's first `seq_len` keys and values, read through its block table."""
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_reqs = block_tables.shape[0]
        blocks_per_req = -(-seq_len // block_size)
        block_ids = block_tables[:, :blocks_per_req].flatten()  # [R * nb]
        rows = (2, num_reqs * blocks_per_req, block_size * num_kv_heads * head_dim)
        out = self._take(rows[0] * rows[1] * rows[2], kv_cache).view(rows)
        flat = kv_cache.view(2, num_blocks, rows[2])  # [2, num_blocks, block_size * Hkv * D]
        torch.index_select(flat, 1, block_ids, out=out)  # [2, R * nb, block_size * Hkv * D]
        kv = out.view(2, num_reqs, blocks_per_req * block_size, num_kv_heads, head_dim)
        return kv[:, :, :seq_len].transpose(2, 3)  # [2, R, Hkv, seq_len, D]

    def _take(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        buffer = self._buffer
        if (
            buffer is None
            or buffer.numel() < numel
            or buffer.dtype != like.dtype
            or buffer.device != like.device
        ):
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffer = buffer
        return buffer[:numel]


def _decode(
    query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    workspace: _Workspace,
) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
    num_decodes = query.shape[0]
    seq_lens = metadata.seq_lens_cpu[:num_decodes]
    max_len = max(seq_lens)
    kv = workspace.gather_kv(kv_cache, metadata.block_tables[:num_decodes], max_len)
    mask = None
    if min(seq_lens) != max_len:
        positions = torch.arange(max_len, device=query.device)  # [max_len]
        lens = metadata.seq_lens[:num_decodes, None]  # [num_decodes, 1]
        mask = (positions < lens)[:, None, None, :]  # [num_decodes, 1, 1, max_len]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # [num_decodes, H, 1, D]
        kv[0],  # [num_decodes, Hkv, max_len, D]
        kv[1],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )  # [num_decodes, H, 1, D]
    return out.squeeze(2)


def _prefill_one(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    req: int,
    key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim], this step's keys
    value: torch.Tensor | None,
    workspace: _Workspace,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    query_len = query.shape[0]
    seq_len = metadata.seq_lens_cpu[req]
    num_cached = seq_len - query_len
    if num_cached == 0 and key is not None and value is not None:
        # No cached context: the keys are exactly this step's, no need to read the cache.
        start = metadata.query_start_loc_cpu[req]
        k = key[start : start + query_len].transpose(0, 1)  # [Hkv, query_len, D]
        v = value[start : start + query_len].transpose(0, 1)
    else:
        kv = workspace.gather_kv(kv_cache, metadata.block_tables[req : req + 1], seq_len)
        k, v = kv[0, 0], kv[1, 0]  # [Hkv, seq_len, D]
    mask = None
    if num_cached > 0:
        mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=query.device)
        mask = mask.tril_(diagonal=num_cached)  # [query_len, seq_len]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1),  # [H, query_len, D]
        k,
        v,
        attn_mask=mask,
        is_causal=num_cached == 0,
        scale=scale,
        enable_gqa=True,
    )  # [H, query_len, D]
    return out.transpose(0, 1)
