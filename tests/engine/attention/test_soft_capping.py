"""Attention logit soft-capping (Gemma 2) in every attention backend: each score, after
the scale and before the mask, becomes cap * tanh(score / cap). Checked against a dense
reference over decodes and prefill chunks with and without cached context, alone and with
a sliding window; a cap far above every score changes nothing, a small one changes the
output (so the reference comparison could fail)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.attention.backend import AttentionParams
from kernels import ref_paged_attention
from tests.engine.core.test_sliding_window import _backend, _batch
from tests.triton_utils import import_triton


def _reference(query, keys, values, num_cached, scale, cap, window):
    """query [q, H, D], keys/values [ctx, Hkv, D]: causal, soft-capped, optionally windowed."""
    group = query.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)  # [ctx, H, D]
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, k) * scale  # [H, q, ctx]
    scores = torch.tanh(scores / cap) * cap
    q_pos = torch.arange(query.shape[0])[:, None] + num_cached  # [q, 1]
    k_pos = torch.arange(keys.shape[0])[None, :]  # [1, ctx]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("backend_name", ["torch", "cpu", "triton"])
@pytest.mark.parametrize(("cap", "window"), [(0.5, None), (3.0, None), (1.0, 5)])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (4, 4)])
def test_backends_soft_cap_the_scores(backend_name, cap, window, num_heads, num_kv_heads):
    head_dim, block_size, scale = 16, 4, 0.3
    query, key, value, kv_cache, metadata, requests, contexts = _batch(
        num_heads, num_kv_heads, head_dim, block_size
    )
    backend = _backend(backend_name)
    uncapped_params = AttentionParams(scale, sliding_window=window)
    capped_params = replace(uncapped_params, logits_soft_cap=cap)
    out = backend.forward(query, key, value, kv_cache, metadata, capped_params)
    uncapped = backend.forward(query, key, value, kv_cache, metadata, uncapped_params)
    for (n, q, _), ctx, start in zip(requests, contexts, metadata.query_start_loc_cpu):
        ref = _reference(query[start : start + q], ctx[0], ctx[1], n, scale, cap, window)
        torch.testing.assert_close(out[start : start + q], ref, atol=3e-5, rtol=1e-4)
    assert (out - uncapped).abs().max() > 1e-2  # the cap bites at these scores
    # A cap far above every score is (numerically) no cap.
    loose_params = replace(uncapped_params, logits_soft_cap=1e4)
    loose = backend.forward(query, key, value, kv_cache, metadata, loose_params)
    torch.testing.assert_close(loose, uncapped, atol=2e-5, rtol=1e-4)


def test_triton_kernel_rejects_a_non_positive_cap():
    import_triton()
    from kernels import paged_attention

    query, _, _, kv_cache, metadata, _, _ = _batch(4, 2, 16, 4)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        paged_attention(
            query.contiguous(),
            kv_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            scale=0.3,
            logits_soft_cap=0.0,
        )


def test_reference_kernel_soft_caps():
    """The Triton kernels' torch reference (what the GPU tests compare against) caps too."""
    from engine.attention.torch_backend import scatter_kv

    query, key, value, kv_cache, metadata, requests, contexts = _batch(4, 2, 16, 4)
    scatter_kv(key, value, kv_cache, metadata.slot_mapping)  # this step's keys into the cache
    out = ref_paged_attention(
        query,
        kv_cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        0.3,
        logits_soft_cap=0.7,
    )
    for (n, q, _), ctx, start in zip(requests, contexts, metadata.query_start_loc_cpu):
        ref = _reference(query[start : start + q], ctx[0], ctx[1], n, 0.3, 0.7, None)
        torch.testing.assert_close(out[start : start + q], ref, atol=3e-5, rtol=1e-4)
