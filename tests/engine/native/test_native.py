"""The CPU fast paths: native C kernels (engine.native), the `cpu` attention backend, and
MKL-packed linears (engine.layers.linear), each against the pure-torch path it replaces."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams, native
from engine.api.model_files import load_hf_config
from engine.attention.backend import AttentionParams, get_attention_backend
from engine.attention.cpu_backend import CPUAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.layers.linear import linear, pack_weight, packing_available
from engine.layers.ops import apply_rotary_emb
from engine.loader.model_loader import load_model
from kernels.reference import ref_paged_attention
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.model_utils import allocate_block_tables, build_attn_metadata, make_tiny_llama

pytestmark = pytest.mark.skipif(
    not native.native_kernels_available(), reason="no C compiler: native kernels not built"
)


# --- paged decode attention -----------------------------------------------------------------


@pytest.mark.parametrize(
    "num_reqs,num_heads,num_kv_heads,head_dim,block_size",
    [
        (1, 9, 3, 64, 16),  # batch 1: work split per KV head
        (2, 4, 4, 128, 8),
        (12, 9, 3, 64, 16),  # enough requests: work split per request
        (9, 8, 1, 80, 5),  # MQA, head_dim off the specialised sizes, odd block size
        (10, 6, 2, 20, 1),  # head_dim not a multiple of the vector width
    ],
)
def test_paged_decode_attention_matches_reference(
    num_reqs, num_heads, num_kv_heads, head_dim, block_size
):
    gen = torch.Generator().manual_seed(num_reqs * 100 + head_dim)
    seq_lens = torch.randint(1, 90, (num_reqs,), generator=gen).to(torch.int32)
    num_blocks = int(sum(-(-int(n) // block_size) for n in seq_lens)) + 4
    tables = allocate_block_tables(seq_lens.tolist(), block_size, num_blocks, seed=1)
    width = max(len(t) for t in tables) + 2  # padded rows, as the model runner builds them
    block_tables = torch.zeros(num_reqs, width, dtype=torch.int32)
    for r, table in enumerate(tables):
        block_tables[r, : len(table)] = torch.tensor(table)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    # Strided query rows, as the model passes a view of the fused QKV projection.
    qkv = torch.randn(num_reqs, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    query = qkv[:, :num_heads]
    scale = head_dim**-0.5
    max_len = int(seq_lens.max()) + 3  # longer than every context: the tail is masked
    out = native.paged_decode_attention(query, kv_cache, block_tables, seq_lens, max_len, scale)
    query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32)
    expected = ref_paged_attention(
        query.contiguous(), kv_cache, block_tables, seq_lens, query_start_loc, scale
    )
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_paged_decode_attention_rejects_bad_layouts():
    kv_cache = torch.zeros(2, 4, 4, 2, 8)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    seq_lens = torch.tensor([3], dtype=torch.int32)
    query = torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match="float32"):
        native.paged_decode_attention(query.double(), kv_cache, tables, seq_lens, 3, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        native.paged_decode_attention(query, kv_cache, tables.long(), seq_lens, 3, 1.0)
    with pytest.raises(ValueError, match="query strides"):
        native.paged_decode_attention(query.transpose(1, 2), kv_cache, tables, seq_lens, 3, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        native.paged_decode_attention(torch.zeros(1, 3, 8), kv_cache, tables, seq_lens, 3, 1.0)


# --- paged prefill attention ----------------------------------------------------------------


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [
        (9, 3, 64, 16),  # the default model's shape
        (4, 4, 128, 8),  # MHA, the other specialised head size
        (8, 1, 80, 5),  # MQA, head_dim off the specialised sizes, odd block size
        (6, 2, 20, 1),  # head_dim not a multiple of the vector width
    ],
)
def test_paged_prefill_attention_matches_reference(num_heads, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(head_dim)
    # (num_computed, query_len): two decodes the kernel must skip, then prefill chunks with
    # and without cached context, and contexts longer than one key segment (256) so the
    # softmax is carried across segments.
    shapes = [(9, 1), (30, 1), (0, 37), (5, 7), (250, 40), (0, 300), (3, 16), (40, 2)]
    num_blocks = sum(-(-(n + q) // block_size) for n, q in shapes) + 3
    tables = allocate_block_tables([n + q for n, q in shapes], block_size, num_blocks, seed=2)
    metadata = build_attn_metadata(
        [(n, q, t) for (n, q), t in zip(shapes, tables)], block_size=block_size
    )
    num_tokens = metadata.slot_mapping.shape[0]
    qkv = torch.randn(num_tokens, num_heads + 2, head_dim, generator=gen)
    query = qkv[:, :num_heads]  # strided rows, as the model passes them
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = torch.full((num_tokens, num_heads, head_dim), 7.0)
    native.paged_prefill_attention(
        out,
        query,
        kv_cache,
        metadata.block_tables,
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.num_decodes,
        scale,
    )
    expected = ref_paged_attention(
        query.contiguous(),
        kv_cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        scale,
    )
    first = metadata.query_start_loc_cpu[metadata.num_decodes]
    end = metadata.query_start_loc_cpu[-1]
    torch.testing.assert_close(out[first:end], expected[first:end], atol=2e-6, rtol=1e-5)
    # Decode rows are not the kernel's: left as they were.
    assert (out[:first] == 7.0).all()


def test_paged_prefill_attention_rejects_bad_layouts():
    kv_cache = torch.zeros(2, 4, 4, 2, 8)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    seq_lens = torch.tensor([3], dtype=torch.int32)
    starts = torch.tensor([0, 3], dtype=torch.int32)
    query = torch.zeros(3, 4, 8)
    out = torch.zeros(3, 4, 8)
    args = (kv_cache, tables, starts, seq_lens, 0, 1.0)
    native.paged_prefill_attention(out, query, *args)  # the valid call
    with pytest.raises(ValueError, match="out"):
        native.paged_prefill_attention(out[:2], query, *args)
    with pytest.raises(ValueError, match="query_start_loc"):
        native.paged_prefill_attention(
            out, query, kv_cache, tables, starts.long(), seq_lens, 0, 1.0
        )
    with pytest.raises(ValueError, match="ends past"):
        native.paged_prefill_attention(
            out[:2], query[:2], kv_cache, tables, starts, seq_lens, 0, 1.0
        )
    with pytest.raises(ValueError, match="first_req"):
        native.paged_prefill_attention(out, query, kv_cache, tables, starts, seq_lens, 2, 1.0)
    with pytest.raises(ValueError, match="float32"):
        native.paged_prefill_attention(out, query.double(), *args)


# --- elementwise kernels ----------------------------------------------------------------------


@pytest.mark.parametrize("rows,cols", [(1, 48), (7, 576), (300, 250)])  # 300 x 250: threaded
def test_rms_norm_kernel_matches_torch(rows, cols):
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, cols + 5, generator=gen)
    x = wide[:, :cols]  # strided rows
    residual = torch.randn(rows, cols, generator=gen)
    weight = torch.rand(cols, generator=gen) + 0.5
    expected = F.rms_norm(x, (cols,), weight, 1e-5)
    torch.testing.assert_close(native.rms_norm(x, weight, 1e-5), expected, atol=1e-6, rtol=1e-5)
    out, summed = native.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
    expected = F.rms_norm(x + residual, (cols,), weight, 1e-5)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="residual"):
        native.rms_norm(x, weight, 1e-5, residual[:, :-1])


@pytest.mark.parametrize("rows,inter", [(1, 1536), (5, 100), (64, 1536)])  # 64 x 1536: threaded
def test_silu_and_mul_kernel_matches_torch(rows, inter):
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 2 * inter + 3, generator=gen) * 4
    wide[0, :6] = torch.tensor([-200.0, -88.0, -30.0, 0.0, 30.0, 200.0])  # exp's edges
    x = wide[:, : 2 * inter]  # strided rows
    expected = F.silu(x[:, :inter]) * x[:, inter:]
    out = native.silu_and_mul(x)
    assert out.shape == (rows, inter) and out.is_contiguous()
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=2e-6)
    with pytest.raises(ValueError, match="silu_and_mul"):
        native.silu_and_mul(x[:, :-1])  # odd width


@pytest.mark.parametrize("rows,cols", [(1, 49152), (64, 1000), (3, 17), (2, 1)])
def test_argmax_kernel_matches_torch(rows, cols):
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(rows, cols + 3, generator=gen)[:, :cols]  # strided rows
    assert torch.equal(native.argmax(x), x.argmax(dim=-1))


def test_argmax_kernel_ties_nan_and_inf_as_torch():
    x = torch.zeros(4, 40)
    x[0, 5] = x[0, 30] = 1.0  # tie: the first
    x[1, 7] = x[1, 2] = float("nan")  # NaN wins, the first one
    x[2] = -float("inf")  # all -inf: index 0
    x[3, 39] = float("inf")
    assert native.argmax(x).tolist() == x.argmax(dim=-1).tolist() == [5, 2, 0, 39]
    with pytest.raises(ValueError, match="argmax"):
        native.argmax(x.double())


@pytest.mark.parametrize("rows,num_heads,head_dim", [(3, 5, 64), (700, 12, 32)])
def test_rotary_kernel_matches_torch(rows, num_heads, head_dim):
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, num_heads + 2, head_dim, generator=gen)
    angles = torch.rand(rows, 1, head_dim // 2, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((-angles.sin(), angles.sin()), -1)
    expected = apply_rotary_emb(qkv[:, :num_heads], cos, sin)
    untouched = qkv[:, num_heads:].clone()
    out = native.rotary_inplace(qkv[:, :num_heads], cos, sin)
    assert out.data_ptr() == qkv.data_ptr()  # in place
    torch.testing.assert_close(qkv[:, :num_heads], expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(qkv[:, num_heads:], untouched, atol=0, rtol=0)


def test_write_kv_kernel_matches_torch_backend():
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(6, 2 + 2 * 3, 8, generator=gen)
    key, value = qkv[:, 2:5], qkv[:, 5:8]  # strided rows, as the model passes them
    slot_mapping = torch.tensor([5, 7, 0, 11, 2, 9])
    ours = torch.zeros(2, 3, 4, 3, 8)
    native.write_kv(key, value, ours, slot_mapping)
    expected = torch.zeros(2, 3, 4, 3, 8)
    TorchAttentionBackend().write_kv(key, value, expected, slot_mapping)
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)
    assert ours.any()


# --- the cpu backend against the torch backend ------------------------------------------------


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (4, 1)])
def test_cpu_backend_matches_torch_backend(num_heads, num_kv_heads):
    block_size, head_dim, scale = 4, 16, 0.25
    gen = torch.Generator().manual_seed(num_heads)
    # (num_computed, query_len): ten decodes (enough for per-request work), three prefills.
    # The last prefill runs past one key segment (256) of the native prefill kernel.
    shapes = [(9, 1), (0, 1), (30, 1), (39, 1), (17, 1)] * 2 + [(0, 12), (5, 7), (250, 30)]
    num_blocks = 240
    tables = allocate_block_tables([n + q for n, q in shapes], block_size, num_blocks, seed=3)
    metadata = build_attn_metadata(
        [(n, q, t) for (n, q), t in zip(shapes, tables)], block_size=block_size
    )
    num_tokens = metadata.slot_mapping.shape[0]
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    query = qkv[:, :num_heads]
    key = qkv[:, num_heads : num_heads + num_kv_heads]
    value = qkv[:, num_heads + num_kv_heads :]
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    expected_cache = cache.clone()
    params = AttentionParams(scale)
    out = CPUAttentionBackend().forward(query, key, value, cache, metadata, params)
    expected = TorchAttentionBackend().forward(query, key, value, expected_cache, metadata, params)
    torch.testing.assert_close(cache, expected_cache, atol=0, rtol=0)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_default_cpu_backend_is_native_and_falls_back_without_a_compiler(tmp_path):
    assert get_attention_backend(None, torch.device("cpu")).name == "cpu"
    # In a fresh process with no usable compiler and an empty kernel cache: a warning that
    # names the reason, and the pure-torch backend.
    script = textwrap.dedent(
        """
        import logging, torch
        logging.basicConfig(level=logging.WARNING)
        from engine.attention.backend import get_attention_backend
        print("BACKEND", get_attention_backend(None, torch.device("cpu")).name)
        """
    )
    env = {
        **_child_env(),
        "CC": str(tmp_path / "no-such-compiler"),
        "PAGEDSERVE_KERNEL_CACHE_DIR": str(tmp_path / "kernels"),
    }
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "BACKEND torch" in result.stdout
    assert "CPU attention kernels unavailable" in result.stderr
    assert "no-such-compiler" in result.stderr
    with pytest.raises(ValueError, match="runs on the CPU"):
        get_attention_backend("cpu", torch.device("meta"))


def _child_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_NATIVE_CPU_KERNELS"}


def test_engine_tokens_same_with_and_without_native_kernels(tmp_path, monkeypatch):
    path = make_tiny_llama(tmp_path / "m", hidden_size=96, num_heads=6, num_kv_heads=2)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 30, 2)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    common = dict(model=str(path), dtype="float32", block_size=4, kv_cache_memory_bytes=1 << 22)
    fast = LLM(**common)
    assert fast.llm_engine.runner.attn_backend.name == "cpu"
    fast_tokens = [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("PAGEDSERVE_NATIVE_CPU_KERNELS", "0")
    native.native_kernels_available.cache_clear()
    try:
        slow = LLM(**common)
        assert slow.llm_engine.runner.attn_backend.name == "torch"
        outputs = slow.generate(prompts, params, use_tqdm=False)
    finally:
        monkeypatch.delenv("PAGEDSERVE_NATIVE_CPU_KERNELS")
        native.native_kernels_available.cache_clear()
    assert [o.outputs[0].token_ids for o in outputs] == fast_tokens


# --- MKL-packed linears -----------------------------------------------------------------------


@pytest.mark.skipif(not packing_available(), reason="torch built without MKL")
@pytest.mark.parametrize("rows", [1, 2, 3, 64, 200, 2049])
def test_packed_linear_matches_f_linear_for_any_batch(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    bias = torch.randn(96, generator=gen)
    x = torch.randn(rows, 40, generator=gen)
    packed = pack_weight(weight)
    torch.testing.assert_close(
        linear(x, weight, bias, packed), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5
    )


# The model's layers and their measured methods: tests/engine/layers/test_linear_select.py.


# --- batch-1 decode: all layers in one native call ---------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        dict(hidden_size=96, num_heads=6, num_kv_heads=2, num_layers=3),
        # MQA, head_dim off the vector width, biases on every projection.
        dict(
            hidden_size=40,
            num_heads=4,
            num_kv_heads=1,
            head_dim=10,
            num_layers=2,
            attention_bias=True,
            mlp_bias=True,
            intermediate_size=37,
        ),
    ],
    ids=["gqa", "mqa-biases"],
)
def test_native_decode_matches_the_layer_path(tmp_path, shape):
    path = make_tiny_llama(tmp_path / "m", **shape)
    config = load_hf_config(path)
    backend = CPUAttentionBackend()
    model = load_model(path, config, torch.float32, torch.device("cpu"), backend)
    decode_step = backend.whole_step_decode(model)
    assert decode_step is not None
    block_size, num_blocks = 4, 24
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_heads"]
    cache_shape = (2, num_blocks, block_size, shape["num_kv_heads"], head_dim)
    caches = [torch.zeros(cache_shape) for _ in range(shape["num_layers"])]
    table = [7, 2, 19, 11, 5]
    gen = torch.Generator().manual_seed(0)
    prompt_len = 13
    prompt = torch.randint(3, config.vocab_size, (prompt_len,), generator=gen)
    with torch.inference_mode():
        prefill = build_attn_metadata([(0, prompt_len, table)], block_size=block_size)
        model(prompt, torch.arange(prompt_len), caches, prefill)
        decode = build_attn_metadata([(prompt_len, 1, table)], block_size=block_size)
        token, position = torch.tensor([42]), torch.tensor([prompt_len])
        layer_caches = [c.clone() for c in caches]
        assert decode_step.applies(decode)
        fast = decode_step(token, position, caches, decode)
        expected = model(token, position, layer_caches, decode)
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(caches, layer_caches):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    slot = table[prompt_len // block_size] * block_size + prompt_len % block_size
    assert caches[0][0].flatten(0, 1)[slot].abs().sum() > 0  # the token's key was written


def test_native_decode_engine_matches_transformers(tmp_path):
    # One request: every decode step takes the native all-layers path.
    path = make_tiny_llama(
        tmp_path / "m",
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        attention_bias=True,
        mlp_bias=True,
    )
    prompts = [[5, 9, 2, 33, 17, 4, 8], [3]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=5)
    llm = LLM(model=str(path), dtype="float32", block_size=4)
    ours = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
    assert_close_to_reference(hf_greedy(path, prompts, 20), ours_greedy(ours))


def test_native_decode_rejects_bad_inputs():
    hidden = torch.zeros(8)
    layers = torch.zeros(1, len(native.DECODE_LAYER_FIELDS), dtype=torch.int64)
    cos = sin = torch.zeros(4)
    table = torch.zeros(2, dtype=torch.int32)
    args = (2, 1, 4, 16, 4, 1e-5, 0.5)
    with pytest.raises(ValueError, match="hidden"):
        native.decode_token(hidden.double(), layers, cos, sin, table, 3, 0, *args)
    with pytest.raises(ValueError, match="fields"):
        native.decode_token(hidden, layers[:, :-1], cos, sin, table, 3, 0, *args)
    with pytest.raises(ValueError, match="blocks for 9 tokens"):
        native.decode_token(hidden, layers, cos, sin, table, 9, 0, *args)
    with pytest.raises(ValueError, match="cos/sin"):
        native.decode_token(hidden, layers, cos[:3], sin, table, 3, 0, *args)


def test_march_override_names_the_build_and_rejects_junk(monkeypatch):
    from engine.native.build import NATIVE_MARCH_ENV, NativeKernelError, compile_flags

    assert compile_flags()[0] == "-march=native"
    monkeypatch.setenv(NATIVE_MARCH_ENV, "x86-64-v3")  # what an AVX2-only CPU would get
    assert compile_flags()[0] == "-march=x86-64-v3"
    monkeypatch.setenv(NATIVE_MARCH_ENV, "native -o /tmp/x")
    with pytest.raises(NativeKernelError, match=NATIVE_MARCH_ENV):
        compile_flags()


def test_every_header_is_part_of_the_kernel_cache_key():
    """The library's cache key hashes `_HEADERS`: a header left out of it could change
    without a rebuild, and a stale library would keep its old code."""
    from pathlib import Path

    from engine.native import build

    headers = {p.name for p in Path(build.__file__).parent.glob("*.h")}
    assert headers == {p.name for p in build._HEADERS}
