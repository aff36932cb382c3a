"""Our Llama over the paged cache against transformers, plus the ops and the torch backend."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.api.model_files import load_hf_config
from engine.attention import torch_backend
from engine.attention.backend import AttentionParams
from engine.attention.torch_backend import TorchAttentionBackend
from engine.layers.ops import rms_norm, silu_and_mul
from engine.loader.model_loader import load_model
from engine.models.llama import LlamaForCausalLM, get_kv_cache_shape, kv_cache_bytes_per_token
from tests.model_utils import (
    allocate_block_tables,
    build_attn_metadata,
    build_positions,
    make_tiny_llama,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

MODEL_SHAPES = {
    "gqa_tied": dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
    "mha_untied": dict(num_heads=4, num_kv_heads=4),
    "mqa_head_dim_32": dict(num_heads=4, num_kv_heads=1, head_dim=32),
    "llama3_rope": dict(num_heads=4, num_kv_heads=2, rope_scaling=LLAMA3_ROPE, num_layers=3),
    "linear_rope_bias": dict(
        num_heads=2,
        num_kv_heads=1,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        attention_bias=True,
        mlp_bias=True,
    ),
}

BLOCK_SIZE = 4
NUM_BLOCKS = 48


def _load_pair(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    hf_config = load_hf_config(path)
    ours = load_model(path, hf_config, dtype, torch.device("cpu"), TorchAttentionBackend())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return ours, hf, hf_config


def _new_caches(model: LlamaForCausalLM, dtype=torch.float32) -> list[torch.Tensor]:
    shape = get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    # Large finite values: a key read from a slot that was never written dominates its
    # softmax and shows in the logits. (Not NaN: padded slots are masked, not skipped, so
    # the cache must hold finite values, as a zero-initialised one does.)
    return [torch.full(shape, 1e3, dtype=dtype) for _ in model.model.layers]


def _run_step(model, caches, steps_tokens, requests):
    """Runs one step; returns logits [num_tokens, vocab]."""
    metadata = build_attn_metadata(requests, block_size=BLOCK_SIZE)
    positions = build_positions(requests)
    input_ids = torch.tensor(steps_tokens)
    hidden = model(input_ids, positions, caches, metadata)
    assert hidden.shape == (len(input_ids), model.config.hidden_size)
    return model.compute_logits(hidden[: metadata.num_actual_tokens])


class _Scenario:
    """Requests with known full token lists; tracks what each step fed and got back."""

    def __init__(self, vocab_size: int, lengths: dict[str, int], seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.tokens = {
            name: torch.randint(0, vocab_size, (n,), generator=gen).tolist()
            for name, n in lengths.items()
        }
        self.tables = dict(
            zip(lengths, allocate_block_tables(list(lengths.values()), BLOCK_SIZE, NUM_BLOCKS))
        )
        self.got: dict[str, dict[int, torch.Tensor]] = {name: {} for name in lengths}

    def step(self, model, caches, chunks: list[tuple[str, int, int]]):
        """`chunks`: (request, num_computed, query_len) in batch order."""
        requests = [(n0, q, self.tables[name]) for name, n0, q in chunks]
        ids = [t for name, n0, q in chunks for t in self.tokens[name][n0 : n0 + q]]
        logits = _run_step(model, caches, ids, requests)
        row = 0
        for name, n0, q in chunks:
            for pos in range(n0, n0 + q):
                self.got[name][pos] = logits[row]
                row += 1

    def check(self, hf_model, atol=1e-4):
        for name, rows in self.got.items():
            with torch.no_grad():
                ref = hf_model(torch.tensor([self.tokens[name]])).logits[0].float()
            positions = sorted(rows)
            ours = torch.stack([rows[p] for p in positions])
            torch.testing.assert_close(ours, ref[positions], atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("shape", MODEL_SHAPES.values(), ids=MODEL_SHAPES.keys())
@torch.inference_mode()
def test_logits_match_transformers_through_paged_steps(tmp_path, shape):
    path = make_tiny_llama(tmp_path / "m", **shape)
    model, hf, _ = _load_pair(path)
    caches = _new_caches(model)
    sc = _Scenario(model.config.vocab_size, {"a": 8, "b": 14, "c": 21, "d": 17, "e": 3})
    # 1: three prompts of different lengths in one batch.
    sc.step(model, caches, [("a", 0, 5), ("b", 0, 11), ("c", 0, 17)])
    # 2: decodes, plus the first chunk of a new prompt.
    sc.step(model, caches, [("a", 5, 1), ("b", 11, 1), ("c", 17, 1), ("d", 0, 7)])
    # 3: decodes, a one-token prompt (laid out as a decode), the second chunk.
    sc.step(
        model,
        caches,
        [("a", 6, 1), ("b", 12, 1), ("c", 18, 1), ("e", 0, 1), ("d", 7, 6)],
    )
    # 4: everyone decodes; 5: two decodes and a last chunk over cached context.
    sc.step(model, caches, [("a", 7, 1), ("b", 13, 1), ("c", 19, 1), ("e", 1, 1), ("d", 13, 1)])
    sc.step(model, caches, [("c", 20, 1), ("e", 2, 1), ("d", 14, 3)])
    sc.check(hf)


@torch.inference_mode()
def test_single_request_prefill_then_decode(tmp_path):
    """The backend's one-request fast paths (whole batch = one prefill / one decode)."""
    path = make_tiny_llama(tmp_path / "m", tie_word_embeddings=True)
    model, hf, _ = _load_pair(path)
    caches = _new_caches(model)
    sc = _Scenario(model.config.vocab_size, {"a": 12})
    sc.step(model, caches, [("a", 0, 9)])
    sc.step(model, caches, [("a", 9, 1)])
    sc.step(model, caches, [("a", 10, 2)])  # a chunk over cached context
    sc.check(hf)


@torch.inference_mode()
def test_bfloat16_close_to_transformers(tmp_path):
    path = make_tiny_llama(tmp_path / "m")
    model, hf, _ = _load_pair(path, torch.bfloat16)
    caches = _new_caches(model, torch.bfloat16)
    sc = _Scenario(model.config.vocab_size, {"a": 10, "b": 6})
    sc.step(model, caches, [("a", 0, 9), ("b", 0, 6)])
    sc.step(model, caches, [("a", 9, 1)])
    for rows in sc.got.values():
        assert all(row.dtype == torch.float32 for row in rows.values())
    sc.check(hf, atol=0.1)


def test_kv_cache_helpers(tmp_path):
    path = make_tiny_llama(tmp_path / "m", num_kv_heads=2, head_dim=32, num_layers=3)
    config = load_hf_config(path)
    assert get_kv_cache_shape(10, 16, 2, 32) == (2, 10, 16, 2, 32)
    assert kv_cache_bytes_per_token(config, torch.float32) == 3 * 2 * 2 * 32 * 4
    assert kv_cache_bytes_per_token(config, torch.bfloat16) == 3 * 2 * 2 * 32 * 2


def test_load_weights_rejects_unexpected_missing_and_misshapen(tmp_path):
    from safetensors.torch import load_file

    path = make_tiny_llama(tmp_path / "m")
    state = load_file(str(path / "model.safetensors"))
    model = LlamaForCausalLM(load_hf_config(path), TorchAttentionBackend())
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.extra\.weight'"):
        model.load_weights([*state.items(), ("model.extra.weight", torch.zeros(1))])
    partial = {k: v for k, v in state.items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.self_attn\.qkv_proj"):
        model.load_weights(partial.items())
    bad = dict(state, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        model.load_weights(bad.items())
    # Old checkpoints carry rotary inv_freq buffers; they are ignored.
    extra = ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8))
    model.load_weights([*state.items(), extra])


def test_fused_projections_hold_hf_shards(tmp_path):
    from safetensors.torch import load_file

    path = make_tiny_llama(tmp_path / "m", num_heads=4, num_kv_heads=2)
    state = load_file(str(path / "model.safetensors"))
    model = LlamaForCausalLM(load_hf_config(path), TorchAttentionBackend())
    model.load_weights(state.items())
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    prefix = "model.layers.1.self_attn."
    expected = torch.cat([state[prefix + f"{n}_proj.weight"] for n in "qkv"])
    torch.testing.assert_close(qkv, expected, atol=0, rtol=0)
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    mlp = "model.layers.0.mlp."
    expected = torch.cat([state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]])
    torch.testing.assert_close(gate_up, expected, atol=0, rtol=0)


# --- ops -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    ref = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 48, dtype=dtype)
    residual = torch.randn(5, 48, dtype=dtype)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0, "rtol": 0}
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, ref.weight, 1e-5), ref(x), **tol)
        out, new_residual = rms_norm(x, ref.weight, 1e-5, residual)
        torch.testing.assert_close(new_residual, x + residual, atol=0, rtol=0)
        torch.testing.assert_close(out, ref(x + residual), **tol)


def test_silu_and_mul():
    x = torch.randn(3, 10)
    torch.testing.assert_close(silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])


# --- torch backend against a dense reference -------------------------------------------------


def _reference_attention(query, keys, values, num_cached, scale):
    """Dense causal attention for one request: query [q, H, D], keys/values [ctx, Hkv, D]."""
    group = query.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = query.transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, q, ctx]
    q_pos = torch.arange(query.shape[0])[:, None] + num_cached
    scores = scores.masked_fill(torch.arange(k.shape[1])[None, :] > q_pos, -math.inf)
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [q, H, D]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("decode_path", ["matmul", "head_loop", "split_groups"])
def test_torch_backend_matches_dense_reference(
    monkeypatch, num_heads, num_kv_heads, block_size, decode_path
):
    if decode_path == "head_loop":
        monkeypatch.setattr(torch_backend, "_MIN_TOKENS_FOR_HEAD_LOOP", 0)
    elif decode_path == "matmul":
        monkeypatch.setattr(torch_backend, "_MAX_KV_HEADS_FOR_HEAD_LOOP", 0)
    else:  # at most two requests' contexts per gather
        max_bytes = 2 * 40 * num_kv_heads * 8 * 4 * 2
        monkeypatch.setattr(torch_backend, "_MAX_GATHER_BYTES_CPU", max_bytes)
    head_dim, scale = 8, 0.3
    gen = torch.Generator().manual_seed(block_size * 10 + num_heads)
    # (num_computed, query_len): five decodes of mixed lengths, then three prefill chunks.
    shapes = [(9, 1), (0, 1), (30, 1), (39, 1), (17, 1), (0, 12), (5, 7), (33, 1 + 6)]
    num_blocks = 200 // block_size + 8
    tables = allocate_block_tables([n + q for n, q in shapes], block_size, num_blocks, seed=3)
    requests = [(n, q, t) for (n, q), t in zip(shapes, tables)]
    metadata = build_attn_metadata(requests, block_size=block_size)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    # The cached context of each request, written straight into its blocks.
    contexts = []
    for n, q, table in requests:
        ctx = torch.randn(2, n + q, num_kv_heads, head_dim, generator=gen)
        for pos in range(n):
            kv_cache[:, table[pos // block_size], pos % block_size] = ctx[:, pos]
        contexts.append(ctx)
    num_tokens = metadata.slot_mapping.shape[0]
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    key = torch.zeros(num_tokens, num_kv_heads, head_dim)
    value = torch.zeros(num_tokens, num_kv_heads, head_dim)
    for (n, q, _), ctx, start in zip(requests, contexts, metadata.query_start_loc_cpu):
        key[start : start + q], value[start : start + q] = ctx[0, n:], ctx[1, n:]
    backend = TorchAttentionBackend()
    before = kv_cache.clone()
    out = backend.forward(query, key, value, kv_cache, metadata, AttentionParams(scale))
    assert out.shape == query.shape
    for (n, q, _), ctx, start in zip(requests, contexts, metadata.query_start_loc_cpu):
        ref = _reference_attention(query[start : start + q], ctx[0], ctx[1], n, scale)
        torch.testing.assert_close(out[start : start + q], ref, atol=1e-5, rtol=1e-5)
    # attend() reads everything from the cache and gives the same answer.
    attended = backend.attend(query, kv_cache, metadata, AttentionParams(scale))
    torch.testing.assert_close(attended, out)
    # Only the step's slots changed.
    num_slots = num_blocks * block_size
    changed = (kv_cache != before).view(2, num_slots, -1).any(-1).any(0).nonzero().squeeze(1)
    written = metadata.slot_mapping[: metadata.num_actual_tokens]
    assert set(changed.tolist()) <= set(written.tolist())


def test_write_kv_writes_only_the_given_slots():
    backend = TorchAttentionBackend()
    kv_cache = torch.zeros(2, 3, 4, 2, 8)
    key = torch.randn(3, 2, 8)
    value = torch.randn(3, 2, 8)
    slot_mapping = torch.tensor([5, 0, 11])
    backend.write_kv(key, value, kv_cache, slot_mapping)
    flat = kv_cache.view(2, 12, 2, 8)
    for token, slot in [(0, 5), (1, 0), (2, 11)]:
        torch.testing.assert_close(flat[0, slot], key[token])
        torch.testing.assert_close(flat[1, slot], value[token])
    untouched = [s for s in range(12) if s not in (0, 5, 11)]
    assert not flat[:, untouched].any()
