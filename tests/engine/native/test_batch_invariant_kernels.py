"""The batch-invariant native kernels (EngineArgs `batch_invariant`): a row's output is
bitwise the same alone and at any place in batches of any size, on every ISA path this CPU
runs, and close to the plain kernels' (the same math, another summation order).

- `invariant_linear`, every weight format (fp32, GGUF blocks, int8),
- `paged_prefill_attention(batch_invariant=True)`: one request's rows prefilled whole, in
  chunks of any size, or one token at a time (decode rows) give the same bits, with and
  without a sliding window and on fp32 and fp16 caches.
"""

from __future__ import annotations

import pytest
import torch

from engine.native import native_kernels_available, paged_prefill_attention
from engine.native.batch_invariant import invariant_linear
from engine.native.quant import (
    QType,
    QuantizedWeight,
    available_isas,
    fp32_weight,
    quant_linear,
    quantize_int8,
    set_isa,
)
from tests.engine.gguf_files import random_blocks

pytestmark = pytest.mark.skipif(not native_kernels_available(), reason="no C compiler")

BATCHES = (1, 2, 3, 4, 5, 8, 17, 33, 64, 70, 130)


def _weight(qtype: QType, n: int, k: int) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(int(qtype))
    if qtype == QType.F32:
        return fp32_weight(torch.randn(n, k, generator=generator) * 0.1)
    if qtype == QType.INT8:
        return quantize_int8(torch.randn(n, k, generator=generator))
    data = torch.from_numpy(random_blocks(qtype, n, k, seed=int(qtype)))
    return QuantizedWeight(data.contiguous(), qtype, k)


@pytest.fixture(params=[isa.name for isa in available_isas()])
def isa(request):
    isa = next(i for i in available_isas() if i.name == request.param)
    set_isa(isa)
    yield isa
    set_isa(None)


@pytest.mark.parametrize("qtype", list(QType), ids=lambda q: q.name)
def test_invariant_linear_rows_do_not_depend_on_the_batch(isa, qtype):
    k = 512 if qtype in (QType.Q4_K, QType.Q6_K) else 96
    weight = _weight(qtype, 37, k)  # 37 outputs: uneven per-thread ranges and tails
    x = torch.randn(max(BATCHES), k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(37, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([invariant_linear(x[r : r + 1], weight, bias) for r in range(len(x))])
    for size in BATCHES:
        for start in {0, len(x) - size, (len(x) - size) // 3}:
            out = invariant_linear(x[start : start + size], weight, bias)
            assert torch.equal(out, alone[start : start + size]), (size, start)
    expected = quant_linear(x, weight, bias)
    torch.testing.assert_close(alone, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def _paged_cache(num_tokens: int, block_size: int, kv_heads: int, head_dim: int, dtype):
    generator = torch.Generator().manual_seed(3)
    num_blocks = (num_tokens + block_size - 1) // block_size + 3
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=generator)
    table = torch.randperm(num_blocks, generator=generator)[None, :].to(torch.int32)
    return cache.to(dtype), table


def _attend(query, cache, table, start: int, end: int, window, invariant=True):
    """Rows [start, end) of one request as a chunk after `start` cached tokens."""
    out = torch.empty_like(query[start:end])
    paged_prefill_attention(
        out,
        query[start:end].contiguous(),
        cache,
        table,
        torch.tensor([0, end - start], dtype=torch.int32),
        torch.tensor([end], dtype=torch.int32),
        0,
        0.125,
        sliding_window=window,
        batch_invariant=invariant,
    )
    return out


@pytest.mark.parametrize("window", [None, 23])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_invariant_attention_rows_do_not_depend_on_the_chunk(window, dtype):
    # 300 tokens: two of the kernel's 256-key segments; 8 query heads over 2 KV heads.
    num_tokens, heads, kv_heads, head_dim, block_size = 300, 8, 2, 64, 16
    cache, table = _paged_cache(num_tokens, block_size, kv_heads, head_dim, dtype)
    query = torch.randn(num_tokens, heads, head_dim, generator=torch.Generator().manual_seed(4))
    whole = _attend(query, cache, table, 0, num_tokens, window)
    for chunk in (1, 7, 16, 45, 129):
        pieces = [
            _attend(query, cache, table, s, min(s + chunk, num_tokens), window)
            for s in range(0, num_tokens, chunk)
        ]
        assert torch.equal(torch.cat(pieces), whole), f"chunks of {chunk}"
    plain = _attend(query, cache, table, 0, num_tokens, window, invariant=False)
    torch.testing.assert_close(whole, plain, rtol=1e-5, atol=1e-5)


def test_invariant_attention_in_a_batch_of_requests():
    """The request's rows beside other requests' rows (one call, decodes and chunks mixed)
    equal its rows alone."""
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 16
    cache, _ = _paged_cache(4 * 13 * block_size, block_size, kv_heads, head_dim, torch.float32)
    num_blocks = cache.shape[1]
    generator = torch.Generator().manual_seed(5)
    lens, q_lens = [90, 33, 200, 1], [1, 33, 50, 1]  # decode, whole prompt, chunk, decode
    tables = torch.randperm(num_blocks, generator=generator)[: 4 * 13].view(4, 13)
    tables = tables.to(torch.int32).contiguous()
    query = torch.randn(sum(q_lens), heads, head_dim, generator=generator)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.empty_like(query)
    paged_prefill_attention(
        out, query, cache, tables, starts, torch.tensor(lens, dtype=torch.int32), 0, 0.2,
        batch_invariant=True,
    )  # fmt: skip
    for r in range(4):
        rows = slice(int(starts[r]), int(starts[r + 1]))
        alone = torch.empty_like(query[rows])
        paged_prefill_attention(
            alone, query[rows].contiguous(), cache, tables[r : r + 1],
            torch.tensor([0, q_lens[r]], dtype=torch.int32),
            torch.tensor([lens[r]], dtype=torch.int32), 0, 0.2, batch_invariant=True,
        )  # fmt: skip
        assert torch.equal(out[rows], alone), f"request {r}"


def test_the_plain_kernel_is_batch_variant(isa):
    """What the invariant kernel is for: `quant_linear` (row kernels up to 16 rows, the
    GEMM above, each with its own summation order) gives some row other bits in a batch of
    64 than alone, so the equalities above are not free."""
    weight = _weight(QType.Q4_1, 37, 96)
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([quant_linear(x[r : r + 1], weight) for r in range(len(x))])
    assert not torch.equal(quant_linear(x, weight), alone)
