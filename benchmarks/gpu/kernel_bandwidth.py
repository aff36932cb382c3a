"""Kernel micro-benchmarks: time, achieved memory bandwidth and its share of the peak.

    python benchmarks/gpu/kernel_bandwidth.py                  # peak bandwidth from the device name
    python benchmarks/gpu/kernel_bandwidth.py --peak-gbps 3350 # or given explicitly

Bandwidth is the bytes a kernel must move (read + write, each byte once) divided by its
time; for the memory-bound kernels here (decode attention, KV write, RMSNorm, rotary,
SiLU-and-mul) that fraction of the peak is the figure of merit. The prefill attention case
is compute-bound, so it also prints TFLOP/s. Each kernel is checked against its torch
reference on the benchmark shape before it is timed. Needs a CUDA GPU; without one it says
so and exits with status 0.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path: put the repository root there
# instead, so that no name in benchmarks/gpu/ can shadow a package (tests/test_benchmarks.py).
if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

DEVICE = "cuda"
# Peak HBM bandwidth in GB/s, matched against torch.cuda.get_device_name(); first match wins.
PEAK_GBPS = (
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),
)


@dataclass
class Case:
    name: str
    run: Callable[[], object]
    num_bytes: int  # bytes the kernel has to read and write
    flops: int = 0  # matmul FLOPs, for the compute-bound cases


def _peak_gbps(override: float | None) -> float | None:
    if override is not None:
        return override
    name = torch.cuda.get_device_name()
    for marker, gbps in PEAK_GBPS:
        if marker in name:
            return gbps
    return None


def _paged_attention_case(
    name: str,
    num_reqs: int,
    query_len: int,
    context_len: int,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
) -> Case:
    from kernels import paged_attention, ref_paged_attention

    dev = torch.device(DEVICE)
    blocks_per_req = -(-context_len // block_size)
    num_blocks = num_reqs * blocks_per_req
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=dev).to(dtype)
    block_tables = torch.randperm(num_blocks, device=dev).to(torch.int32)
    block_tables = block_tables.view(num_reqs, blocks_per_req)
    seq_lens = torch.full((num_reqs,), context_len, dtype=torch.int32, device=dev)
    query_start_loc = torch.arange(0, num_reqs + 1, dtype=torch.int32, device=dev) * query_len
    query = torch.randn(num_reqs * query_len, num_heads, head_dim, device=dev).to(dtype)
    out = torch.empty_like(query)
    scale = head_dim**-0.5

    def run() -> torch.Tensor:
        return paged_attention(
            query,
            kv_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            max_query_len=query_len,
            max_seq_len=context_len,
            scale=scale,
            out=out,
        )

    expected = ref_paged_attention(query, kv_cache, block_tables, seq_lens, query_start_loc, scale)
    torch.testing.assert_close(run(), expected, atol=2e-2, rtol=2e-2)

    elem = dtype.itemsize
    kv_bytes = 2 * num_reqs * context_len * num_kv_heads * head_dim * elem
    q_out_bytes = 2 * query.numel() * elem
    table_bytes = block_tables.numel() * 4 + 2 * 4 * num_reqs
    # Each query row sees context_len - query_len + i + 1 keys; QK^T and PV are 2 FLOPs per MAC.
    visible = num_reqs * (query_len * (context_len - query_len) + query_len * (query_len + 1) // 2)
    flops = 4 * visible * num_heads * head_dim
    return Case(name, run, kv_bytes + q_out_bytes + table_bytes, flops)


def _write_kv_case(num_tokens: int = 8192, num_kv_heads: int = 8, head_dim: int = 128) -> Case:
    from kernels import ref_write_kv_cache, write_kv_cache

    dev, dtype, block_size = torch.device(DEVICE), torch.bfloat16, 16
    num_blocks = 2 * num_tokens // block_size
    kv_cache = torch.zeros(
        2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=dev
    )
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=dev).to(dtype)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * block_size, device=dev)[:num_tokens]
    expected = kv_cache.clone()
    ref_write_kv_cache(key, value, expected, slots)
    write_kv_cache(key, value, kv_cache, slots)
    torch.testing.assert_close(kv_cache, expected, atol=0, rtol=0)
    num_bytes = 2 * 2 * key.numel() * dtype.itemsize + slots.numel() * 8  # read + write K, V
    name = f"write_kv_cache T={num_tokens} Hkv={num_kv_heads} D={head_dim} bf16"
    return Case(name, lambda: write_kv_cache(key, value, kv_cache, slots), num_bytes)


def _rms_norm_case(num_tokens: int = 8192, hidden: int = 4096) -> Case:
    from kernels import ref_rms_norm, rms_norm

    dev, dtype = torch.device(DEVICE), torch.bfloat16
    x = torch.randn(num_tokens, hidden, device=dev).to(dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device=dev).to(dtype)
    out, new_residual = rms_norm(x, weight, 1e-5, residual)
    expected_out, expected_residual = ref_rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(new_residual, expected_residual, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, expected_out, atol=2e-2, rtol=2e-2)
    num_bytes = 4 * x.numel() * dtype.itemsize + weight.numel() * dtype.itemsize
    name = f"rms_norm+residual T={num_tokens} hidden={hidden} bf16"
    return Case(name, lambda: rms_norm(x, weight, 1e-5, residual), num_bytes)


def _rotary_case(num_tokens: int = 8192, num_heads: int = 32, num_kv_heads: int = 8) -> Case:
    from kernels import apply_rotary, build_cos_sin_cache, ref_rotary

    dev, dtype, head_dim = torch.device(DEVICE), torch.bfloat16, 128
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    cache = build_cos_sin_cache(inv_freq, 8192, device=dev)
    positions = torch.randint(0, 8192, (num_tokens,), device=dev)
    query = torch.randn(num_tokens, num_heads, head_dim, device=dev).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=dev).to(dtype)
    expected_query, expected_key = ref_rotary(positions, query, key, cache)
    apply_rotary(positions, query, key, cache)
    torch.testing.assert_close(query, expected_query, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(key, expected_key, atol=2e-2, rtol=2e-2)
    # Rotating in place repeatedly is fine for timing: the traffic does not depend on values.
    qk_bytes = 2 * (query.numel() + key.numel()) * dtype.itemsize
    num_bytes = qk_bytes + num_tokens * (8 + head_dim * 4)  # + positions, cos/sin rows
    name = f"apply_rotary T={num_tokens} H={num_heads} Hkv={num_kv_heads} D={head_dim} bf16"
    return Case(name, lambda: apply_rotary(positions, query, key, cache), num_bytes)


def _silu_and_mul_case(num_tokens: int = 8192, intermediate: int = 14336) -> Case:
    from kernels import ref_silu_and_mul, silu_and_mul

    dev, dtype = torch.device(DEVICE), torch.bfloat16
    x = torch.randn(num_tokens, 2 * intermediate, device=dev).to(dtype)
    torch.testing.assert_close(silu_and_mul(x), ref_silu_and_mul(x), atol=2e-2, rtol=2e-2)
    num_bytes = (x.numel() + num_tokens * intermediate) * dtype.itemsize
    name = f"silu_and_mul T={num_tokens} I={intermediate} bf16"
    return Case(name, lambda: silu_and_mul(x), num_bytes)


def _cases() -> list[Case]:
    return [
        # The target shape: >= 70 % of peak bandwidth.
        _paged_attention_case("paged_attention decode B=64 ctx=4096 H=32 Hkv=8 D=128", 64, 1, 4096),
        _paged_attention_case("paged_attention decode B=256 ctx=1024 (GQA 4)", 256, 1, 1024),
        _paged_attention_case("paged_attention decode B=4 ctx=16384 (split-KV)", 4, 1, 16384),
        _paged_attention_case(
            "paged_attention prefill B=4 chunk=2048 (from scratch)", 4, 2048, 2048
        ),
        _write_kv_case(),
        _rms_norm_case(),
        _rotary_case(),
        _silu_and_mul_case(),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--peak-gbps",
        type=float,
        default=None,
        help="peak memory bandwidth in GB/s (default: from the device name; H100 3350, H200 4800)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("No CUDA GPU: nothing to measure. (Kernel correctness runs on CPU in tests/kernels.)")
        return 0

    import triton.testing

    peak = _peak_gbps(args.peak_gbps)
    print(f"device: {torch.cuda.get_device_name()}; peak bandwidth: {peak or 'unknown'} GB/s")
    if peak is None:
        print("(pass --peak-gbps to get the fraction of peak)")
    print(f"{'kernel and shape':<62} {'time us':>9} {'GB/s':>8} {'% peak':>7} {'TFLOP/s':>8}")
    for case in _cases():
        time_ms = triton.testing.do_bench(case.run, warmup=25, rep=200)
        gbps = case.num_bytes / (time_ms * 1e-3) / 1e9
        share = f"{100 * gbps / peak:6.1f}%" if peak else "      -"
        tflops = f"{case.flops / (time_ms * 1e-3) / 1e12:8.1f}" if case.flops else "       -"
        print(f"{case.name:<62} {time_ms * 1e3:9.1f} {gbps:8.0f} {share:>7} {tflops}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
