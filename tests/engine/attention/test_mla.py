"""Paged multi-head latent attention (engine/attention/mla.py) against a float64 reference
that up-projects every key and value: the absorbed decode path and the up-projecting prefill
path, over shuffled block tables, with cached context and a narrower cache dtype."""

from __future__ import annotations

import pytest
import torch

from engine.attention.mla import MLAWeights, TorchMLAAttention
from tests.model_utils import allocate_block_tables, build_attn_metadata

H, NOPE, ROPE, V, RANK = 4, 16, 8, 12, 24
BLOCK_SIZE, NUM_BLOCKS = 4, 64


def reference(q_nope, q_pe, entries, kv_b, seq_len, scale):
    """Full attention of the last q tokens over `seq_len` entries, in float64."""
    q_nope, q_pe, entries, kv_b = (t.double() for t in (q_nope, q_pe, entries, kv_b))
    kv = (entries[:, :RANK] @ kv_b.T).view(seq_len, H, NOPE + V)
    key = torch.cat((kv[..., :NOPE], entries[:, None, RANK:].expand(-1, H, -1)), dim=-1)
    query = torch.cat((q_nope, q_pe), dim=-1)  # [Q, H, NOPE + ROPE]
    scores = torch.einsum("qhd,khd->hqk", query, key) * scale
    num_cached = seq_len - query.shape[0]
    mask = torch.ones(query.shape[0], seq_len, dtype=torch.bool).tril_(num_cached)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, kv[..., NOPE:])  # [Q, H, V]


# (num_computed, query_len) per request: decodes first, then prefill chunks with and
# without cached context.
BATCHES = {
    "decodes": [(5, 1), (17, 1), (0, 1)],
    "mixed": [(9, 1), (30, 1), (0, 7), (12, 5)],
    "prefill-only": [(0, 13), (40, 3)],
}


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_matches_the_up_projected_reference(batch, cache_dtype) -> None:
    torch.manual_seed(0)
    requests = BATCHES[batch]
    seq_lens = [c + q for c, q in requests]
    tables = allocate_block_tables(seq_lens, BLOCK_SIZE, NUM_BLOCKS)
    kv_b = torch.randn(H * (NOPE + V), RANK) * 0.3
    weights = MLAWeights.from_kv_b(kv_b, H, NOPE, V)
    kv_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, RANK + ROPE, dtype=cache_dtype)
    # Every request's whole context, the cached part written beforehand.
    contexts = [torch.randn(n, RANK + ROPE) for n in seq_lens]
    for (num_computed, _), table, context in zip(requests, tables, contexts, strict=True):
        positions = torch.arange(num_computed)
        slots = torch.tensor(table)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        kv_cache.view(-1, RANK + ROPE)[slots] = context[:num_computed].to(cache_dtype)
    metadata = build_attn_metadata(
        [(c, q, t) for (c, q), t in zip(requests, tables, strict=True)], block_size=BLOCK_SIZE
    )
    new = torch.cat([ctx[c:] for (c, _), ctx in zip(requests, contexts, strict=True)])
    num_tokens = new.shape[0]
    q_nope, q_pe = torch.randn(num_tokens, H, NOPE), torch.randn(num_tokens, H, ROPE)
    scale = 0.2
    out = TorchMLAAttention()(q_nope, q_pe, new, kv_cache, metadata, weights, scale)
    start = 0
    for (_, query_len), seq_len, context in zip(requests, seq_lens, contexts, strict=True):
        end = start + query_len
        rounded = context.to(cache_dtype).float()  # what the cache holds
        expected = reference(q_nope[start:end], q_pe[start:end], rounded, kv_b, seq_len, scale)
        torch.testing.assert_close(out[start:end].double(), expected, atol=2e-5, rtol=2e-5)
        start = end
