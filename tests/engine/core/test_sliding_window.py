"""Sliding-window attention (Mistral; Qwen2's windowed layers) in every attention backend
and in the KV-cache manager.

Each backend is checked against a dense reference in which query position p sees keys
(p - W, p] (transformers' sliding-window mask); the model against transformers with prompts
longer than the window; the KV-cache manager frees blocks behind every live window."""

from __future__ import annotations

import pytest
import torch

from engine.api.model_files import load_hf_config
from engine.api.sampling_params import SamplingParams
from engine.attention.backend import AttentionParams, get_attention_backend
from engine.attention.cpu_backend import CPUAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.loader.model_loader import load_model
from tests.model_utils import (
    allocate_block_tables,
    build_attn_metadata,
    build_positions,
    make_tiny_model,
)
from tests.triton_utils import import_triton

# (num_computed, query_len): decodes of mixed lengths, then prefill chunks with and without
# cached context, one running past the native prefill kernel's key segment (256).
SHAPES = [(9, 1), (0, 1), (30, 1), (3, 1), (0, 12), (5, 7), (20, 9), (250, 30)]


def _dense_reference(query, keys, values, num_cached, scale, window):
    """query [q, H, D], keys/values [ctx, Hkv, D]: causal attention limited to the window."""
    group = query.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)  # [ctx, H, D]
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, k) * scale  # [H, q, ctx]
    q_pos = torch.arange(query.shape[0])[:, None] + num_cached  # [q, 1]
    k_pos = torch.arange(keys.shape[0])[None, :]  # [1, ctx]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _batch(num_heads, num_kv_heads, head_dim, block_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(n + q) // block_size) for n, q in SHAPES) + 4
    tables = allocate_block_tables([n + q for n, q in SHAPES], block_size, num_blocks, seed=1)
    requests = [(n, q, t) for (n, q), t in zip(SHAPES, tables)]
    metadata = build_attn_metadata(requests, block_size=block_size)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    contexts = []
    for n, q, table in requests:
        ctx = torch.randn(2, n + q, num_kv_heads, head_dim, generator=gen)
        for pos in range(n):
            kv_cache[:, table[pos // block_size], pos % block_size] = ctx[:, pos]
        contexts.append(ctx)
    num_tokens = metadata.slot_mapping.shape[0]
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    key = qkv[:, num_heads : num_heads + num_kv_heads]
    value = qkv[:, num_heads + num_kv_heads :]
    for (n, q, _), ctx, start in zip(requests, contexts, metadata.query_start_loc_cpu):
        key[start : start + q], value[start : start + q] = ctx[0, n:], ctx[1, n:]
    return qkv[:, :num_heads], key, value, kv_cache, metadata, requests, contexts


def _backend(name):
    if name == "triton":
        import_triton()
        return get_attention_backend("triton", torch.device("cpu"))  # the interpreter
    return {"torch": TorchAttentionBackend, "cpu": CPUAttentionBackend}[name]()


@pytest.mark.parametrize("backend_name", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("window", [1, 5, 40])
def test_backends_limit_attention_to_the_window(backend_name, window):
    num_heads, num_kv_heads, head_dim, block_size, scale = 4, 2, 16, 4, 0.3
    query, key, value, kv_cache, metadata, requests, contexts = _batch(
        num_heads, num_kv_heads, head_dim, block_size
    )
    out = _backend(backend_name).forward(
        query, key, value, kv_cache, metadata, AttentionParams(scale, sliding_window=window)
    )
    for (n, q, _), ctx, start in zip(requests, contexts, metadata.query_start_loc_cpu):
        ref = _dense_reference(query[start : start + q], ctx[0], ctx[1], n, scale, window)
        torch.testing.assert_close(out[start : start + q], ref, atol=2e-5, rtol=1e-4)
    # A window as long as every context is full causal attention.
    full = _backend(backend_name).forward(
        query, key, value, kv_cache, metadata, AttentionParams(scale)
    )
    wide = _backend(backend_name).forward(
        query, key, value, kv_cache, metadata, AttentionParams(scale, sliding_window=1000)
    )
    torch.testing.assert_close(wide, full, atol=2e-6, rtol=1e-5)


# --- the model against transformers --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral-window")
    return make_tiny_model(
        path, "MistralForCausalLM", sliding_window=6, head_dim=16, tie_word_embeddings=False
    )


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@torch.inference_mode()
def test_windowed_model_logits_match_transformers(tiny_mistral, backend_name):
    from transformers import AutoModelForCausalLM

    config = load_hf_config(tiny_mistral)
    backend = _backend(backend_name)
    model = load_model(tiny_mistral, config, torch.float32, torch.device("cpu"), backend)
    hf = AutoModelForCausalLM.from_pretrained(tiny_mistral, dtype=torch.float32).eval()
    tokens = torch.randint(3, config.vocab_size, (23,), generator=torch.Generator().manual_seed(0))
    block_size = 4
    caches = [torch.zeros(2, 12, block_size, 2, 16) for _ in range(config.num_hidden_layers)]
    table = [7, 2, 9, 4, 11, 0]
    logits = []
    # A 13-token prefill, a 4-token chunk over cached context, then decodes one by one
    # (the batch-1 decode takes the cpu backend's whole-step path).
    decode_step = backend.whole_step_decode(model)
    for start, end in [(0, 13), (13, 17), *((p, p + 1) for p in range(17, 23))]:
        requests = [(start, end - start, table)]
        metadata = build_attn_metadata(requests, block_size=block_size)
        positions = build_positions(requests)
        if decode_step is not None and decode_step.applies(metadata):
            hidden = decode_step(tokens[start:end], positions, caches, metadata)
        else:
            hidden = model(tokens[start:end], positions, caches, metadata)
        logits.append(model.compute_logits(hidden))
    if backend_name == "cpu":
        assert decode_step is not None, "the whole-step decode takes windowed models too"
    ref = hf(tokens[None]).logits[0]
    torch.testing.assert_close(torch.cat(logits), ref, atol=1e-4, rtol=1e-4)


# --- the KV-cache manager -------------------------------------------------------------------


def _request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, list(range(100, 100 + num_tokens)), SamplingParams(max_tokens=8))


@pytest.mark.parametrize("enable_caching", [True, False])
def test_kv_cache_manager_frees_blocks_behind_the_window(enable_caching):
    manager = KVCacheManager(
        num_blocks=16, block_size=4, enable_caching=enable_caching, sliding_window=6
    )
    request = _request("r", 20)
    assert manager.allocate_slots(request, 20) is not None  # the whole prompt: 5 blocks
    assert manager.get_num_free_blocks() == 11
    request.num_computed_tokens = 20
    request.append_output_token_ids([7])
    # The next query (position 20) sees positions 15..20: blocks 0-2 (positions 0-11) go;
    # with caching, the last published block before the open one stays (chain anchor).
    assert manager.allocate_slots(request, 1) is not None
    freed = 3
    assert manager.get_num_free_blocks() == 16 - 6 + freed
    table = manager.get_block_ids("r")
    assert len(table) == 6 and table[:freed] == [0] * freed
    manager.free(request)
    assert manager.get_num_free_blocks() == 16


def test_kv_cache_manager_keeps_blocks_another_request_still_needs():
    manager = KVCacheManager(num_blocks=16, block_size=4, sliding_window=4)
    first, second = _request("a", 16), _request("b", 16)
    assert manager.allocate_slots(first, 16) is not None
    first.num_computed_tokens = 16
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 12  # the shared prefix
    assert manager.allocate_slots(second, 4, hits, num_hit_tokens) is not None
    first.append_output_token_ids([1])
    assert manager.allocate_slots(first, 1) is not None  # drops its blocks 0-2
    # Request b still holds them: nothing went back to the pool.
    assert manager.get_num_free_blocks() == 16 - 4 - 1 - 1
    manager.free(first)
    manager.free(second)
    assert manager.get_num_free_blocks() == 16
