"""Pure-torch paged attention: runs on any device, the CPU default.

Decode requests (one query token each) are attended together: their blocks are gathered
into one padded batch ``[num_decodes, max_seq_len, num_kv_heads, head_dim]`` and attended
with plain matmuls, query heads grouped by the KV head they share (on CPU this beats SDPA
several times over for a single query token). Padded positions are masked, not skipped, so
the cache must hold finite values everywhere (allocate it with zeros, not empty).

Prefill chunks go one request at a time through SDPA (KV heads repeated to the query
heads, 4-D inputs: the combination that takes torch's fused CPU kernel), each with a causal
mask shifted by its cached context (query token i sits at absolute position
seq_len - query_len + i)::

    keys:     0 1 2 3 4 5      seq_len = 6, query_len = 2, cached = 4
    query 0:  x x x x x .      sees keys j <= cached + 0
    query 1:  x x x x x x      sees keys j <= cached + 1

Loop bounds come from the metadata's host lists, so nothing syncs with the device. A backend
instance keeps one reusable gather buffer: use one instance per model runner (thread).

The cache may be narrower than the model dtype (`kv_cache_dtype`: a bf16/fp16 cache under an
fp32 model): keys and values are rounded to it when written, and gathered blocks are widened
back to the query's dtype before the matmuls, so all arithmetic stays in the model dtype.
A prefill chunk without cached context attends to its own keys rounded the same way, so its
output does not depend on whether they were read back from the cache (a prefix-cache hit
gives the same tokens as a miss).

Soft-capping and attention sinks (AttentionParams) apply to the decode scores; a prefill
chunk with either computes its scores by hand instead of through SDPA, which has neither.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import (
    AttentionMetadata,
    AttentionParams,
    SplitAttentionBackend,
)


class TorchDecode:
    """The decode requests in groups whose gathered context fits `_MAX_GATHER_BYTES`."""

    def __init__(self, workspace: GatherWorkspace) -> None:
        self.workspace = workspace

    def __call__(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        params: AttentionParams,
    ) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
        return _decode(query, kv_cache, metadata, params, self.workspace)


class TorchPrefill:
    """The prefill chunks (requests num_decodes.. of the batch), one SDPA call each."""

    def __init__(self, workspace: GatherWorkspace) -> None:
        self.workspace = workspace

    def __call__(
        self,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim], the prefill rows written
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        params: AttentionParams,
        key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim], this step's keys
        value: torch.Tensor | None,
    ) -> None:
        starts = metadata.query_start_loc_cpu
        for i in range(metadata.num_decodes, metadata.num_reqs):
            start, end = starts[i], starts[i + 1]
            out[start:end] = _prefill_one(
                query[start:end], kv_cache, metadata, params, i, key, value, self.workspace
            )


class TorchAttentionBackend(SplitAttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        workspace = GatherWorkspace()
        super().__init__(scatter_kv, TorchDecode(workspace), TorchPrefill(workspace))


# Bounds the gathered keys/values of one decode group; larger batches are split. On CPU a
# group small enough to stay in cache between the gather and the matmuls that read it back
# runs 20-30% faster than one big gather (measured at 256-512 tokens of context); elsewhere
# fewer, larger groups mean fewer kernel launches.
_MAX_GATHER_BYTES_CPU = 8 << 20
_MAX_GATHER_BYTES = 256 << 20
# Below this many gathered tokens (all decodes x context) the per-KV-head loop costs more in
# op overhead than the one key copy the grouped matmul makes.
_MIN_TOKENS_FOR_HEAD_LOOP = 2048
_MAX_KV_HEADS_FOR_HEAD_LOOP = 8


class GatherWorkspace:
    """Reused buffers for gathered keys/values.

    Gathering a long context makes a large tensor every layer; a fresh one of that size is
    served by mmap and page-faulted in each time, which costs several times the copy itself
    on CPU. One layer's gathered blocks are dead before the next layer runs, so one buffer
    serves every layer and every request of a step (a second one holds them widened, when
    the cache is narrower than the model dtype).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def gather_kv(
        self,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
        seq_len: int,
        dtype: torch.dtype | None = None,  # widen to this (the query's dtype); None: as is
    ) -> torch.Tensor:  # [2, num_reqs, seq_len, num_kv_heads, head_dim]
        """Each request's first `seq_len` keys and values, read through its block table."""
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_reqs = block_tables.shape[0]
        blocks_per_req = -(-seq_len // block_size)
        block_ids = block_tables[:, :blocks_per_req].flatten()  # [R * nb]
        row = block_size * num_kv_heads * head_dim
        numel = 2 * num_reqs * blocks_per_req * row
        out = self._take("gather", numel, kv_cache.dtype, kv_cache.device)
        out = out.view(2, num_reqs * blocks_per_req, row)
        flat = kv_cache.view(2, num_blocks, row)  # [2, num_blocks, block_size * Hkv * D]
        torch.index_select(flat, 1, block_ids, out=out)  # [2, R * nb, block_size * Hkv * D]
        if dtype is not None and dtype != kv_cache.dtype:
            wide = self._take("wide", numel, dtype, kv_cache.device).view(out.shape)
            out = wide.copy_(out)  # [2, R * nb, block_size * Hkv * D] in the query's dtype
        kv = out.view(2, num_reqs, blocks_per_req * block_size, num_kv_heads, head_dim)
        return kv[:, :, :seq_len]  # [2, R, seq_len, Hkv, D]

    def _take(
        self, name: str, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if (
            buffer is None
            or buffer.numel() < numel
            or buffer.dtype != dtype
            or buffer.device != device
        ):
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buffer
        return buffer[:numel]


def scatter_kv(
    key: torch.Tensor,  # [n, num_kv_heads, head_dim]
    value: torch.Tensor,  # [n, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [n] int64
) -> None:
    """Scatters keys and values into the cache slots, rounded to the cache dtype."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)  # [2, slots, Hkv, D]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def _decode(
    query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    params: AttentionParams,
    workspace: GatherWorkspace,
) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
    """The decode requests in groups whose gathered context fits `_MAX_GATHER_BYTES`."""
    num_decodes = query.shape[0]
    seq_lens = metadata.seq_lens_cpu[:num_decodes]
    # Gathered blocks are widened to the query's dtype: size groups by the wider of the two.
    element = max(kv_cache.element_size(), query.element_size())
    token_bytes = 2 * kv_cache.shape[3] * kv_cache.shape[4] * element
    max_bytes = _MAX_GATHER_BYTES_CPU if kv_cache.device.type == "cpu" else _MAX_GATHER_BYTES
    group = max(1, max_bytes // (max(seq_lens) * token_bytes))
    if group >= num_decodes:
        return _decode_group(query, kv_cache, metadata, params, workspace, 0, num_decodes)
    out = query.new_empty(query.shape)  # [num_decodes, num_heads, head_dim]
    for start in range(0, num_decodes, group):
        end = min(start + group, num_decodes)
        out[start:end] = _decode_group(
            query[start:end], kv_cache, metadata, params, workspace, start, end
        )
    return out


def _decode_group(
    query: torch.Tensor,  # [R, num_heads, head_dim], requests start..end
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    params: AttentionParams,
    workspace: GatherWorkspace,
    start: int,
    end: int,
) -> torch.Tensor:  # [R, num_heads, head_dim]
    """One query token per request against its padded, gathered context.

    Plain matmuls beat SDPA's CPU kernels several times over for one query token. Query
    heads are grouped by the KV head they share (GQA), so keys are never repeated.
    """
    num_reqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group_size = num_heads // num_kv_heads
    seq_lens = metadata.seq_lens_cpu[start:end]
    max_len = max(seq_lens)
    kv = workspace.gather_kv(kv_cache, metadata.block_tables[start:end], max_len, query.dtype)
    key, value = kv[0], kv[1]  # [R, max_len, Hkv, D] in the query's dtype
    q = (query * params.scale).view(num_reqs, num_kv_heads, group_size, head_dim)  # [R, Hkv, G, D]
    pad = None  # [R, max_len] True where a key is not seen: past the end, before the window
    window = params.sliding_window
    if min(seq_lens) != max_len or (window is not None and max_len > window):
        positions = torch.arange(max_len, device=query.device)  # [max_len]
        seq = metadata.seq_lens[start:end, None]  # [R, 1]
        pad = positions >= seq
        if window is not None:
            pad |= positions < seq - window
    if num_kv_heads == 1 or (
        num_kv_heads <= _MAX_KV_HEADS_FOR_HEAD_LOOP
        and num_reqs * max_len >= _MIN_TOKENS_FOR_HEAD_LOOP
    ):
        # Per KV head, the strided key/value views go to bmm as they are: no copy.
        out = query.new_empty(num_reqs, num_kv_heads, group_size, head_dim)  # [R, Hkv, G, D]
        for h in range(num_kv_heads):
            scores = torch.bmm(q[:, h], key[:, :, h].transpose(1, 2))  # [R, G, max_len]
            scores = _soft_cap(scores, params.logits_soft_cap)
            sinks = None
            if params.sinks is not None:  # this KV head's query heads: [1, G, 1]
                sinks = params.sinks[h * group_size : (h + 1) * group_size].view(1, -1, 1)
            probs = _softmax(scores, None if pad is None else pad[:, None, :], sinks)
            out[:, h] = torch.bmm(probs, value[:, :, h])  # [R, G, D]
    else:
        # One grouped matmul; it copies the keys into head-major order first.
        scores = torch.matmul(q, key.permute(0, 2, 3, 1))  # [R, Hkv, G, max_len]
        scores = _soft_cap(scores, params.logits_soft_cap)
        sinks = None if params.sinks is None else params.sinks.view(1, num_kv_heads, group_size, 1)
        probs = _softmax(scores, None if pad is None else pad[:, None, None, :], sinks)
        out = torch.matmul(probs, value.transpose(1, 2))  # [R, Hkv, G, D]
    return out.view(num_reqs, num_heads, head_dim)


def _soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's attention logit soft-capping: cap * tanh(scores / cap) (None: as is)."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _softmax(
    scores: torch.Tensor, pad: torch.Tensor | None, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax over the last dim in fp32 (as transformers does), padded keys masked out.

    `sinks` (broadcast against scores[..., :1]): each row's sink logit joins the
    denominator as one more column, dropped after the softmax (GPT-OSS's attention sinks)."""
    if pad is not None:
        scores = scores.masked_fill(pad, float("-inf"))
    if sinks is not None:
        column = sinks.to(torch.float32).expand(*scores.shape[:-1], 1)
        combined = torch.cat((scores.float(), column), dim=-1)
        return combined.softmax(-1)[..., :-1].to(scores.dtype)
    if scores.dtype == torch.float32:
        return scores.softmax(-1)
    return scores.softmax(-1, dtype=torch.float32).to(scores.dtype)


def _prefill_one(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    params: AttentionParams,
    req: int,
    key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim], this step's keys
    value: torch.Tensor | None,
    workspace: GatherWorkspace,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """One request's prefill chunk, causal over its cached context plus the chunk."""
    query_len = query.shape[0]
    seq_len = metadata.seq_lens_cpu[req]
    num_cached = seq_len - query_len
    if num_cached == 0 and key is not None and value is not None:
        # No cached context: the keys are exactly this step's, no need to read the cache.
        start = metadata.query_start_loc_cpu[req]
        k = key[start : start + query_len]  # [query_len, Hkv, D]
        v = value[start : start + query_len]
        if kv_cache.dtype != query.dtype:  # as the cache holds them (see the module doc)
            k = k.to(kv_cache.dtype).to(query.dtype)
            v = v.to(kv_cache.dtype).to(query.dtype)
    else:
        kv = workspace.gather_kv(
            kv_cache, metadata.block_tables[req : req + 1], seq_len, query.dtype
        )
        k, v = kv[0, 0], kv[1, 0]  # [seq_len, Hkv, D]
    mask = None
    window = params.sliding_window
    windowed = window is not None and seq_len > window
    if num_cached > 0 or windowed:
        mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=query.device)
        mask = mask.tril_(diagonal=num_cached)  # [query_len, seq_len]
        if windowed:  # query i (position num_cached + i) sees keys > its position - window
            mask = mask.triu_(diagonal=num_cached - window + 1)
    num_heads, num_kv_heads = query.shape[1], k.shape[1]
    if num_kv_heads != num_heads:
        # Repeating the KV heads costs one small copy; SDPA's `enable_gqa` would instead take
        # the unfused math path on CPU, about twice as slow for a 128-token chunk.
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [seq_len, H, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    if params.logits_soft_cap is not None or params.sinks is not None:
        # SDPA has neither soft-capping nor sinks: the matmuls by hand.
        if mask is None:
            mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=query.device).tril_()
        scores = torch.einsum("qhd,khd->hqk", query, k) * params.scale  # [H, query_len, seq_len]
        scores = _soft_cap(scores, params.logits_soft_cap)
        sinks = None if params.sinks is None else params.sinks.view(num_heads, 1, 1)
        probs = _softmax(scores, ~mask, sinks).to(v.dtype)  # [H, query_len, seq_len]
        return torch.einsum("hqk,khd->qhd", probs, v)  # [query_len, H, D]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],  # [1, H, query_len, D]: 4-D takes the fused kernel
        k.transpose(0, 1)[None],  # [1, H, seq_len, D]
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=params.scale,
    )  # [1, H, query_len, D]
    return out[0].transpose(0, 1)
