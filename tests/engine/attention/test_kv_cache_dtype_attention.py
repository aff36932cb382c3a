"""The CPU attention backends (`torch`, `cpu`) over a bf16 or fp16 KV cache under an fp32
model: keys/values are rounded to the cache dtype when written (exactly as torch's `.to()`),
and attention over the cache matches a pure-torch fp32 reference computed from the same
rounded keys/values (kernels/reference.py widens the cache as stored)."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from engine import native
from engine.api.model_files import load_hf_config
from engine.attention.backend import AttentionParams
from engine.attention.cpu_backend import CPUAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.loader.model_loader import load_model
from engine.native.build import _SIGNATURES
from kernels.reference import ref_paged_attention
from tests.model_utils import allocate_block_tables, build_attn_metadata, make_tiny_llama

needs_native = pytest.mark.skipif(
    not native.native_kernels_available(), reason="no C compiler: native kernels not built"
)
CACHE_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
BACKENDS = [
    pytest.param(TorchAttentionBackend, id="torch"),
    pytest.param(CPUAttentionBackend, id="cpu", marks=needs_native),
]
# fp32 arithmetic on both sides, summed in different orders.
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}

# (num_computed, query_len): ten decodes (enough for the native kernel's per-request work
# split), then prefill chunks without and with a cached prefix; the last runs past one key
# segment (256) of the native prefill kernel.
SHAPES = [(9, 1), (0, 1), (30, 1), (39, 1), (17, 1)] * 2 + [(0, 12), (5, 7), (250, 30)]


def _step(
    backend_class: type,
    cache_dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """One mixed step through the backend, checked against the reference."""
    block_size, num_blocks = 4, 240
    gen = torch.Generator().manual_seed(num_heads * 10 + head_dim)
    tables = allocate_block_tables([n + q for n, q in SHAPES], block_size, num_blocks, seed=3)
    metadata = build_attn_metadata(
        [(n, q, t) for (n, q), t in zip(SHAPES, tables)], block_size=block_size
    )
    num_tokens = metadata.slot_mapping.shape[0]
    # Strided views of one fused projection, as the model passes them.
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    query = qkv[:, :num_heads]
    key = qkv[:, num_heads : num_heads + num_kv_heads]
    value = qkv[:, num_heads + num_kv_heads :]
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen).to(cache_dtype)  # the cached context
    scale = head_dim**-0.5
    out = backend_class().forward(
        query,
        key,
        value,
        cache,
        metadata,
        AttentionParams(scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap),
    )
    assert cache.dtype == cache_dtype and out.dtype == torch.float32
    # This step's keys/values sit in their slots rounded exactly as torch rounds.
    flat = cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    assert torch.equal(flat[0, metadata.slot_mapping], key.to(cache_dtype))
    assert torch.equal(flat[1, metadata.slot_mapping], value.to(cache_dtype))
    expected = ref_paged_attention(
        query.contiguous(),
        cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        scale,
        logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window,
    )
    torch.testing.assert_close(out, expected, **TOLERANCE)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("backend_class", BACKENDS)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(9, 3, 64), (4, 1, 16), (6, 2, 20)],  # the default model's GQA; MQA; off the vector width
    ids=["gqa-64", "mqa-16", "gqa-20"],
)
def test_decode_and_prefill_over_a_16_bit_cache(
    backend_class, cache_dtype, num_heads, num_kv_heads, head_dim
):
    _step(backend_class, cache_dtype, num_heads, num_kv_heads, head_dim)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("backend_class", BACKENDS)
def test_sliding_window_over_a_16_bit_cache(backend_class, cache_dtype):
    _step(backend_class, cache_dtype, 6, 2, 32, sliding_window=11)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("backend_class", BACKENDS)
def test_soft_capping_over_a_16_bit_cache(backend_class, cache_dtype):
    _step(backend_class, cache_dtype, 4, 2, 16, logits_soft_cap=2.5)


@needs_native
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_native_write_rounds_like_torch_at_the_edges(cache_dtype):
    """Ties, subnormals, overflow, infinities and NaN round as torch's `.to()` does."""
    info = torch.finfo(cache_dtype)
    specials = [
        0.0,
        -0.0,
        1.0 + info.eps / 2,  # a tie: to even (down)
        1.0 + 3 * info.eps / 2,  # a tie: to even (up)
        float(info.max) * 1.001,  # overflows to inf in fp16, rounds in bf16
        float(info.tiny) / 3,  # subnormal
        float(info.tiny) * 0.75,
        float("inf"),
        float("-inf"),
        65519.0,
        65520.0,  # fp16: the first value that rounds to inf
        -3.0e-8,
    ]
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(4, 2 * 16, generator=gen) * torch.logspace(-6, 6, 32)
    rows[0, : len(specials)] = torch.tensor(specials)
    key, value = rows[:, None, :16].contiguous(), rows[:, None, 16:].contiguous()
    key[1, 0, 0] = float("nan")
    cache = torch.zeros(2, 2, 4, 1, 16, dtype=cache_dtype)
    slot_mapping = torch.tensor([5, 0, -1, 2])
    native.write_kv(key, value, cache, slot_mapping)
    flat = cache.view(2, 8, 1, 16)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        torch.testing.assert_close(
            flat[0, slot], key[t].to(cache_dtype), atol=0, rtol=0, equal_nan=True
        )
        torch.testing.assert_close(flat[1, slot], value[t].to(cache_dtype), atol=0, rtol=0)
    assert not flat[:, 1].any()  # slot -1 skipped


@needs_native
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_native_decode_step_over_a_16_bit_cache_matches_the_layer_path(tmp_path, cache_dtype):
    """Batch-1 whole-step decode (decode_token) against the model's own layers, both on a
    cache of `cache_dtype` filled by the same prefill."""
    path = make_tiny_llama(tmp_path / "m", hidden_size=96, num_heads=6, num_kv_heads=2)
    config = load_hf_config(path)
    backend = CPUAttentionBackend()
    model = load_model(path, config, torch.float32, torch.device("cpu"), backend)
    decode_step = backend.whole_step_decode(model)
    assert decode_step is not None
    block_size, num_blocks, table = 4, 24, [7, 2, 19, 11, 5]
    caches = [torch.zeros(2, num_blocks, block_size, 2, 16, dtype=cache_dtype) for _ in range(2)]
    prompt = torch.randint(3, config.vocab_size, (13,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        prefill = build_attn_metadata([(0, 13, table)], block_size=block_size)
        model(prompt, torch.arange(13), caches, prefill)
        decode = build_attn_metadata([(13, 1, table)], block_size=block_size)
        token, position = torch.tensor([42]), torch.tensor([13])
        layer_caches = [c.clone() for c in caches]
        assert decode_step.applies(decode)
        fast = decode_step(token, position, caches, decode)
        expected = model(token, position, layer_caches, decode)
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=1e-5)
    slot = table[13 // block_size] * block_size + 13 % block_size
    for ours, theirs in zip(caches, layer_caches):
        assert ours.dtype == cache_dtype
        # The new token's key/value: the same fp32 values up to summation order, rounded.
        ulp = 2 * torch.finfo(cache_dtype).eps
        torch.testing.assert_close(ours.float(), theirs.float(), atol=1e-5, rtol=ulp)
    assert caches[0][0].flatten(0, 1)[slot].abs().sum() > 0  # the token's key was written


@needs_native
def test_native_kernels_refuse_caches_they_do_not_read():
    query = torch.zeros(1, 4, 8)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    seq_lens = torch.tensor([3], dtype=torch.int32)
    for dtype in (torch.float64, torch.int16):
        cache = torch.zeros(2, 4, 4, 2, 8, dtype=dtype)
        with pytest.raises(ValueError, match="bfloat16 or float16 cache"):
            native.paged_decode_attention(query, cache, tables, seq_lens, 3, 1.0)
        with pytest.raises(ValueError, match="kv_cache dtype"):
            native.write_kv(query[:, :2], query[:, 2:], cache, torch.tensor([0]))
    with pytest.raises(ValueError, match="write_kv"):  # keys must be fp32
        native.write_kv(
            query[:, :2].bfloat16(),
            query[:, 2:].bfloat16(),
            torch.zeros(2, 4, 4, 2, 8, dtype=torch.bfloat16),
            torch.tensor([0]),
        )


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None,
    reason="builds the kernels for the x86-64 baseline with cc",
)
def test_portable_conversions_without_f16c(tmp_path):
    """The kernels built for the x86-64 baseline (no F16C, no AVX: the portable fp16 code
    of kv_dtype.h) round and widen exactly as torch does."""
    library_path = tmp_path / "baseline.so"
    source = Path(native.__file__).with_name("cpu_kernels.c")
    # -O0: this checks the arithmetic, and builds in seconds.
    flags = ["-O0", "-march=x86-64", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
    subprocess.run(["cc", *flags, str(source), "-o", str(library_path)], check=True, timeout=300)
    library = ctypes.CDLL(str(library_path))
    for name in ("write_kv_f32", "paged_decode_attention_f32"):
        getattr(library, name).argtypes = _SIGNATURES[name]
    # Every fp16 bit pattern once (as fp32 values); the exact midpoints (ties) between
    # neighbouring fp16 and bf16 values; random values and their fp32 neighbours.
    every_half = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    values = [every_half.float(), _midpoints(every_half)]
    every_bf16 = every_half.view(torch.bfloat16)
    values += [every_bf16.float(), _midpoints(every_bf16)]
    noise = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    values.append(noise * torch.logspace(-9, 5, 4096))
    values = torch.cat([*values, values[-1].nextafter(torch.tensor(float("inf")))])
    values = values[: values.numel() // 64 * 64].view(-1, 1, 64).contiguous()
    for cache_dtype, code in ((torch.float16, 2), (torch.bfloat16, 1)):
        cache = torch.zeros(2, values.shape[0], 1, 1, 64, dtype=cache_dtype)
        slots = torch.arange(values.shape[0])
        library.write_kv_f32(
            cache[0].data_ptr(), cache[1].data_ptr(), values.data_ptr(), values.data_ptr(),
            64, slots.data_ptr(), values.shape[0], 64, code,
        )  # fmt: skip
        expected = values.to(cache_dtype).view(cache[0].shape)
        torch.testing.assert_close(cache[0], expected, atol=0, rtol=0, equal_nan=True)
    # Reading: decode attention over an fp16 cache holding every bit pattern but inf/NaN.
    gen = torch.Generator().manual_seed(0)
    finite = every_half[every_half.isfinite()][:2048]
    cache = (finite / 1000).view(2, 16, 4, 1, 16).to(torch.float16)
    query = torch.randn(1, 2, 16, generator=gen)
    tables = torch.arange(16, dtype=torch.int32)[None]
    seq_lens = torch.tensor([64], dtype=torch.int32)
    out, scores = torch.empty(1, 2, 16), torch.empty(1, 2, 64)
    library.paged_decode_attention_f32(
        out.data_ptr(), query.data_ptr(), 32, scores.data_ptr(), cache[0].data_ptr(),
        cache[1].data_ptr(), tables.data_ptr(), 16, seq_lens.data_ptr(), 1, 2, 1, 16, 4, 64, 0,
        0.25, 0.0, None, 1, 2,
    )  # fmt: skip
    expected = ref_paged_attention(
        query, cache, tables, seq_lens, torch.tensor([0, 1], dtype=torch.int32), 0.25
    )
    torch.testing.assert_close(out, expected, **TOLERANCE)


def _midpoints(values: torch.Tensor) -> torch.Tensor:
    """The values halfway between neighbouring finite `values` (exact in fp32)."""
    finite = values[values.isfinite()].double().unique()  # sorted
    return ((finite[1:] + finite[:-1]) / 2).float()
