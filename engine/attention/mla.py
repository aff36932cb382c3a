"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache, in torch.

Each token's cache entry is one row shared by every head (kv_cache_spec.LatentKVSpec)::

    kv_cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
    entry:    | c: kv_lora_rank (after kv_a_layernorm) | k_pe: qk_rope_head_dim (rotated) |

Head h's key and value are up-projections of the latent by `kv_b_proj`, whose rows are,
per head, W_UK[h] (qk_nope_head_dim rows) then W_UV[h] (v_head_dim rows)::

    k_h = W_UK[h] c | k_pe          v_h = W_UV[h] c

Decode never builds them (vLLM's MLA does the same): the score q_nope . W_UK[h] c equals
(W_UK[h]^T q_nope) . c, so the query is absorbed into the latent space once per token and
attention runs as multi-query attention with one "head" of kv_lora_rank + rope dims over
the entries themselves; the output, a mix of latents, is up-projected by W_UV[h] after::

    q_lat = W_UK^T q_nope                [R, H, rank]
    scores = (q_lat | q_pe) . entry      [R, H, L]        (one matmul over the entries)
    o_lat  = softmax(scores) . c         [R, H, rank]
    out    = W_UV o_lat                  [R, H, v_head_dim]

A prefill chunk has many query tokens against the same context, so it up-projects the
context's latents once (one GEMM) and runs SDPA with full keys and values, as transformers
does. Both paths read the same entries; the decode path's reassociation is float noise.

Padded positions are masked from the device's seq_lens (never skipped by a host length), so
a captured CUDA graph that gathers up to max_model_len stays right. Entries are rounded to
the cache dtype when written and widened back to the query's dtype when read; a prefill
without cached context uses this step's entries rounded the same way (a prefix-cache hit
gives the same tokens as a miss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionMetadata


@dataclass
class MLAWeights:
    """One layer's up-projection, as views of `kv_b_proj.weight` [H * (nope + v), rank]."""

    kv_b: torch.Tensor  # [H * (nope + v), rank]
    w_uk: torch.Tensor  # [H, nope, rank]
    w_uv: torch.Tensor  # [H, v, rank]

    @classmethod
    def from_kv_b(cls, kv_b: torch.Tensor, num_heads: int, nope: int, v: int) -> MLAWeights:
        per_head = kv_b.view(num_heads, nope + v, kv_b.shape[1])  # [H, nope + v, rank]
        return cls(kv_b, per_head[:, :nope], per_head[:, nope:])


def write_latent(
    entries: torch.Tensor,  # [num_tokens, rank + rope]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, rank + rope]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Scatters the step's entries into their slots, rounded to the cache dtype."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])  # [slots, rank + rope]
    flat.index_copy_(0, slot_mapping, entries.to(kv_cache.dtype))


def gather_latent(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, C]
    block_tables: torch.Tensor,  # [R, max_blocks_per_req] int32
    length: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [R, length, C] in `dtype`
    """Each request's first `length` entries, read through its block table."""
    block_size, dim = kv_cache.shape[1], kv_cache.shape[2]
    num_blocks = -(-length // block_size)
    blocks = kv_cache[block_tables[:, :num_blocks].long()]  # [R, nb, block_size, C]
    return blocks.view(blocks.shape[0], -1, dim)[:, :length].to(dtype)


class TorchMLAAttention:
    """Paged multi-head latent attention; one instance serves every layer and device."""

    name = "torch"

    def __call__(
        self,
        q_nope: torch.Tensor,  # [T, H, nope]
        q_pe: torch.Tensor,  # [T, H, rope], rotated
        entries: torch.Tensor,  # [T, rank + rope]: this step's, written here first
        kv_cache: torch.Tensor,  # [num_blocks, block_size, rank + rope]
        metadata: AttentionMetadata,
        weights: MLAWeights,
        scale: float,
    ) -> torch.Tensor:  # [T, H, v]
        write_latent(entries, kv_cache, metadata.slot_mapping)
        num_decodes = metadata.num_decodes
        num_heads, v_dim = weights.w_uv.shape[0], weights.w_uv.shape[1]
        out = q_nope.new_empty(q_nope.shape[0], num_heads, v_dim)
        if num_decodes > 0:
            out[:num_decodes] = _decode(
                q_nope[:num_decodes], q_pe[:num_decodes], kv_cache, metadata, weights, scale
            )
        starts = metadata.query_start_loc_cpu
        for i in range(num_decodes, metadata.num_reqs):
            start, end = starts[i], starts[i + 1]
            out[start:end] = _prefill_one(
                q_nope[start:end], q_pe[start:end], entries[start:end], kv_cache, metadata,
                weights, scale, i,
            )  # fmt: skip
        return out


def _decode(
    q_nope: torch.Tensor,  # [R, H, nope]
    q_pe: torch.Tensor,  # [R, H, rope]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, rank + rope]
    metadata: AttentionMetadata,
    weights: MLAWeights,
    scale: float,
) -> torch.Tensor:  # [R, H, v]
    """One query token per request, absorbed into the latent space (module doc)."""
    num_reqs = q_nope.shape[0]
    rank = weights.w_uk.shape[2]
    max_len = max(metadata.seq_lens_cpu[:num_reqs])
    entries = gather_latent(kv_cache, metadata.block_tables[:num_reqs], max_len, q_nope.dtype)
    q_lat = torch.bmm(q_nope.transpose(0, 1), weights.w_uk).transpose(0, 1)  # [R, H, rank]
    query = torch.cat((q_lat, q_pe), dim=-1) * scale  # [R, H, rank + rope]
    scores = torch.bmm(query, entries.transpose(1, 2))  # [R, H, max_len]
    positions = torch.arange(max_len, device=q_nope.device)
    pad = positions[None, :] >= metadata.seq_lens[:num_reqs, None]  # [R, max_len]
    scores = scores.masked_fill(pad[:, None, :], float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(q_nope.dtype)  # [R, H, max_len]
    o_lat = torch.bmm(probs, entries[:, :, :rank])  # [R, H, rank]
    return torch.bmm(o_lat.transpose(0, 1), weights.w_uv.transpose(1, 2)).transpose(0, 1)


def _prefill_one(
    q_nope: torch.Tensor,  # [Q, H, nope]
    q_pe: torch.Tensor,  # [Q, H, rope]
    new_entries: torch.Tensor,  # [Q, rank + rope], this step's
    kv_cache: torch.Tensor,  # [num_blocks, block_size, rank + rope]
    metadata: AttentionMetadata,
    weights: MLAWeights,
    scale: float,
    req: int,
) -> torch.Tensor:  # [Q, H, v]
    """One request's chunk, causal over its cached context plus the chunk, with the
    context's keys and values up-projected (module doc)."""
    query_len, num_heads, nope = q_nope.shape
    rank, v_dim = weights.w_uk.shape[2], weights.w_uv.shape[1]
    seq_len = metadata.seq_lens_cpu[req]
    num_cached = seq_len - query_len
    if num_cached == 0:  # the context is this chunk: as the cache holds it
        entries = new_entries.to(kv_cache.dtype).to(q_nope.dtype)
    else:
        tables = metadata.block_tables[req : req + 1]
        entries = gather_latent(kv_cache, tables, seq_len, q_nope.dtype)[0]  # [S, C]
    kv = F.linear(entries[:, :rank], weights.kv_b).view(seq_len, num_heads, nope + v_dim)
    k_pe = entries[:, None, rank:].expand(seq_len, num_heads, -1)  # [S, H, rope]
    key = torch.cat((kv[..., :nope], k_pe), dim=-1)  # [S, H, nope + rope]
    value = kv[..., nope:]  # [S, H, v]
    query = torch.cat((q_nope, q_pe), dim=-1)  # [Q, H, nope + rope]
    mask = None
    if num_cached > 0:  # query i sits at position num_cached + i
        mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=q_nope.device)
        mask = mask.tril_(diagonal=num_cached)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],  # [1, H, Q, nope + rope]
        key.transpose(0, 1)[None],  # [1, H, S, nope + rope]
        value.transpose(0, 1)[None],  # [1, H, S, v]
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
    )  # [1, H, Q, v]
    return out[0].transpose(0, 1)
