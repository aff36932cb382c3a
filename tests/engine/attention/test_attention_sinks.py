"""Attention sinks (GPT-OSS) in every attention backend: a learned logit per query head joins
the softmax's denominator and attends to no value, so a head can put weight nowhere.

Checked against a naive dense reference (transformers' formulation: the sink as one more
column of the scores, dropped after the softmax) over decodes and prefill chunks with and
without cached context, with GQA and MHA, alone, with a sliding window and with soft-capping.
Sinks far below every score change nothing; large ones shrink the output (so the reference
comparison could fail); `sinks=None` is the plain attention. The C decode kernel also runs
with its context split over threads (few requests), where the sink must count once.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.attention.backend import AttentionParams
from kernels import ref_paged_attention
from tests.engine.core.test_sliding_window import _backend, _batch
from tests.triton_utils import import_triton


def _reference(query, keys, values, num_cached, scale, sinks, window=None, cap=None):
    """query [q, H, D], keys/values [ctx, Hkv, D]: causal, the sink one more softmax column."""
    group = query.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).double()  # [ctx, H, D]
    v = values.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale  # [H, q, ctx]
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    q_pos = torch.arange(query.shape[0])[:, None] + num_cached  # [q, 1]
    k_pos = torch.arange(keys.shape[0])[None, :]  # [1, ctx]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    column = sinks.double().view(-1, 1, 1).expand(-1, query.shape[0], 1)  # [H, q, 1]
    probs = torch.cat((scores, column), dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v).float()


def _sinks(num_heads: int, seed: int = 3) -> torch.Tensor:
    # Around the scores' own size (|score| ~ 1 here), one head's sink dominant.
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed))
    sinks[0] = 4.0
    return sinks


# (window, cap, num_heads, num_kv_heads): every combination on the CPU backends; Triton
# (the interpreter here, slow) on two, and its own grid in tests/kernels.
CASES = [
    (window, cap, heads, kv_heads)
    for window, cap in ((None, None), (5, None), (None, 2.0))
    for heads, kv_heads in ((4, 2), (4, 4))
]


@pytest.mark.parametrize(
    ("backend_name", "window", "cap", "num_heads", "num_kv_heads"),
    [(name, *case) for name in ("torch", "cpu") for case in CASES]
    + [("triton", None, None, 4, 2), ("triton", 5, 2.0, 4, 4)],
)
def test_backends_add_the_sink_to_the_softmax(backend_name, window, cap, num_heads, num_kv_heads):
    head_dim, block_size, scale = 16, 4, 0.3
    query, key, value, kv_cache, metadata, requests, contexts = _batch(
        num_heads, num_kv_heads, head_dim, block_size
    )
    backend = _backend(backend_name)
    sinks = _sinks(num_heads)
    params = AttentionParams(scale, sliding_window=window, logits_soft_cap=cap)
    out = backend.forward(query, key, value, kv_cache, metadata, replace(params, sinks=sinks))
    plain = backend.forward(query, key, value, kv_cache, metadata, params)
    for (n, q, _), ctx, start in zip(requests, contexts, metadata.query_start_loc_cpu):
        ref = _reference(query[start : start + q], ctx[0], ctx[1], n, scale, sinks, window, cap)
        torch.testing.assert_close(out[start : start + q], ref, atol=3e-5, rtol=1e-4)
    # The dominant sink of head 0 takes most of its weight: its output shrinks.
    assert out[:, 0].norm() < 0.5 * plain[:, 0].norm()
    # Sinks far below every score are (numerically) no sinks.
    far_below = replace(params, sinks=torch.full_like(sinks, -1e4))
    none = backend.forward(query, key, value, kv_cache, metadata, far_below)
    torch.testing.assert_close(none, plain, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("context", [7, 300])
def test_native_decode_counts_the_sink_once_over_split_contexts(context):
    """One request and one KV head: the C decode kernel splits its context over the threads
    (merge_parts), and the sink must join the merged sum once, not once per part."""
    from engine.native import native_kernels_available, paged_decode_attention

    if not native_kernels_available():
        pytest.skip("no native kernels (no C compiler)")
    gen = torch.Generator().manual_seed(0)
    num_heads, head_dim, block_size = 4, 16, 8
    num_blocks = -(-context // block_size)
    kv_cache = torch.randn(2, num_blocks, block_size, 1, head_dim, generator=gen)
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32)[None]  # [1, nb]
    query = torch.randn(1, num_heads, head_dim, generator=gen)
    sinks = _sinks(num_heads)
    keys = kv_cache[0, table[0].long()].reshape(-1, 1, head_dim)[:context]
    values = kv_cache[1, table[0].long()].reshape(-1, 1, head_dim)[:context]
    ref = _reference(query, keys, values, context - 1, 0.25, sinks)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 4):  # 4: several parts per item (parts_per_item)
            torch.set_num_threads(num_threads)
            out = paged_decode_attention(
                query,
                kv_cache,
                table,
                torch.tensor([context], dtype=torch.int32),
                context,
                0.25,
                sinks=sinks,
            )
            torch.testing.assert_close(out, ref, atol=3e-5, rtol=1e-4)
    finally:
        torch.set_num_threads(threads)


def test_reference_kernel_adds_sinks():
    """The Triton kernels' torch reference (what the GPU tests compare against) takes sinks."""
    from engine.attention.torch_backend import scatter_kv

    query, key, value, kv_cache, metadata, requests, contexts = _batch(4, 2, 16, 4)
    scatter_kv(key, value, kv_cache, metadata.slot_mapping)  # this step's keys into the cache
    sinks = _sinks(4)
    out = ref_paged_attention(
        query,
        kv_cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        0.3,
        sinks=sinks,
    )
    for (n, q, _), ctx, start in zip(requests, contexts, metadata.query_start_loc_cpu):
        ref = _reference(query[start : start + q], ctx[0], ctx[1], n, 0.3, sinks)
        torch.testing.assert_close(out[start : start + q], ref, atol=3e-5, rtol=1e-4)


def test_triton_kernel_rejects_misshapen_sinks():
    import_triton()
    from kernels import paged_attention

    query, _, _, kv_cache, metadata, _, _ = _batch(4, 2, 16, 4)
    with pytest.raises(ValueError, match="sinks"):
        paged_attention(
            query.contiguous(),
            kv_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            scale=0.3,
            sinks=torch.zeros(3),
        )
