"""Launchers reject layouts, dtypes and shapes they do not support, naming the argument."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels import apply_rotary, paged_attention, rms_norm, silu_and_mul, write_kv_cache
from tests.kernels._helpers import device, make_paged_batch


def _attention_args(**overrides) -> dict:
    batch = make_paged_batch(
        [1, 3], [5, 20], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
        dtype=torch.float16,
    )  # fmt: skip
    args = {
        "query": batch.query,
        "kv_cache": batch.kv_cache,
        "block_tables": batch.block_tables,
        "seq_lens": batch.seq_lens,
        "query_start_loc": batch.query_start_loc,
        "max_query_len": batch.max_query_len,
        "max_seq_len": batch.max_seq_len,
        "scale": 0.1,
    }
    for name, change in overrides.items():
        args[name] = change(args[name])
    return args


def _call_attention(**overrides) -> Callable[[], object]:
    args = _attention_args(**overrides)
    return lambda: paged_attention(
        args.pop("query"),
        args.pop("kv_cache"),
        args.pop("block_tables"),
        args.pop("seq_lens"),
        args.pop("query_start_loc"),
        **args,
    )


ATTENTION_CASES = {
    # fp16 query: a cache in its dtype or a 16-bit kv_cache_dtype, never a wider one.
    "cache_wider_than_query": ({"kv_cache": lambda t: t.float()}, "kv_cache dtype"),
    "query_int": ({"query": lambda t: t.to(torch.int32)}, "query must have dtype"),
    "query_2d": ({"query": lambda t: t.flatten(1)}, r"query must be \[num_tokens"),
    "query_last_dim_strided": (
        {"query": lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)},
        "query must be contiguous in its last dimension",
    ),
    "cache_not_contiguous": (
        {"kv_cache": lambda t: t.transpose(3, 4).contiguous().transpose(3, 4)},
        "kv_cache must be contiguous",
    ),
    "cache_k_v_axis_last": (
        {"kv_cache": lambda t: t.permute(1, 2, 3, 4, 0).contiguous()},
        "kv_cache dim 0 must be 2",
    ),
    "cache_4d": ({"kv_cache": lambda t: t[0]}, r"kv_cache must be \[2, num_blocks"),
    "heads_not_multiple": ({"query": lambda t: t[:, :3]}, "must be a multiple of num_kv_heads"),
    "head_dim_mismatch": ({"query": lambda t: t[..., :16]}, "kv_cache head_dim 32"),
    "block_tables_int64": ({"block_tables": lambda t: t.long()}, "block_tables must have dtype"),
    "seq_lens_int64": ({"seq_lens": lambda t: t.long()}, "seq_lens must have dtype"),
    "query_start_loc_short": (
        {"query_start_loc": lambda t: t[:-1]},
        "query_start_loc 3",
    ),
    "max_query_len_zero": ({"max_query_len": lambda _: 0}, "max_query_len must be >= 1"),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_paged_attention_rejects(case: str) -> None:
    overrides, message = ATTENTION_CASES[case]
    with pytest.raises(ValueError, match=message):
        _call_attention(**overrides)()


def test_paged_attention_rejects_unsupported_head_dim() -> None:
    query = torch.zeros(1, 2, 12, device=device())
    kv_cache = torch.zeros(2, 1, 16, 1, 12, device=device())
    table = torch.zeros(1, 1, dtype=torch.int32, device=device())
    lens = torch.ones(1, dtype=torch.int32, device=device())
    starts = torch.tensor([0, 1], dtype=torch.int32, device=device())
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8"):
        paged_attention(
            query, kv_cache, table, lens, starts, max_query_len=1, max_seq_len=1, scale=1.0
        )


def test_write_kv_cache_rejects() -> None:
    kv_cache = torch.zeros(2, 4, 16, 2, 32, device=device())
    key = torch.zeros(3, 2, 32, device=device())
    slots = torch.tensor([0, 1, -1], device=device())
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        write_kv_cache(key, key, kv_cache, slots.to(torch.int32))
    with pytest.raises(ValueError, match="key dtype"):
        write_kv_cache(key.half(), key, kv_cache, slots)
    with pytest.raises(ValueError, match=r"value must be \[num_tokens, 2, 32\]"):
        write_kv_cache(key, key[:, :1], kv_cache, slots)
    with pytest.raises(ValueError, match="same number of tokens"):
        write_kv_cache(key, key, kv_cache, slots[:2])
    with pytest.raises(ValueError, match="kv_cache must be contiguous"):
        write_kv_cache(key, key, kv_cache.transpose(1, 2).contiguous().transpose(1, 2), slots)


def test_rms_norm_rejects() -> None:
    x = torch.zeros(3, 8, device=device())
    weight = torch.ones(8, device=device())
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, weight.half(), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm(x, weight, 1e-6, torch.zeros(3, 7, device=device()))
    with pytest.raises(ValueError, match="x must be contiguous in its last dimension"):
        rms_norm(x.t().contiguous().t(), weight, 1e-6)


def test_rotary_rejects() -> None:
    positions = torch.zeros(3, dtype=torch.int64, device=device())
    query = torch.zeros(3, 2, 16, device=device())
    key = torch.zeros(3, 1, 16, device=device())
    cache = torch.zeros(10, 16, device=device())
    with pytest.raises(ValueError, match="partial rotary is not supported"):
        apply_rotary(positions, query, key, cache[:, :8].contiguous())
    with pytest.raises(ValueError, match="positions must have dtype"):
        apply_rotary(positions.float(), query, key, cache)
    with pytest.raises(ValueError, match="key has 2 tokens"):
        apply_rotary(positions, query, key[:2], cache)


def test_silu_and_mul_rejects() -> None:
    with pytest.raises(ValueError, match="must be even"):
        silu_and_mul(torch.zeros(2, 7, device=device()))
    with pytest.raises(ValueError, match="x must have dtype"):
        silu_and_mul(torch.zeros(2, 8, dtype=torch.int32, device=device()))


def test_cpu_tensors_rejected_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        silu_and_mul(torch.zeros(2, 8))
