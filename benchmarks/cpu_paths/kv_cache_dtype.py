"""CPU decode attention with an fp32, bf16 and fp16 KV cache (`kv_cache_dtype`).

    python benchmarks/cpu_paths/kv_cache_dtype.py                    # SmolLM2's shape, 64 requests
    python benchmarks/cpu_paths/kv_cache_dtype.py --contexts 512 2048 --num-reqs 64 --repeats 30

One layer's decode step of the `cpu` backend's native kernel (engine.native
.paged_decode_attention): every request's query token over its whole paged context, blocks
shuffled over the pool as the engine hands them out. A decode step streams the keys and
values of every context once, so halving the cache's bytes is what a 16-bit cache buys; the
kernel widens them back to fp32 as it reads. The three caches hold the same values (the fp32
one is the bf16 one widened), outputs are checked against each other, and the timings are
interleaved (fp32, bf16, fp16, fp32, ...) so a shared machine's slow phases hit all three;
medians are reported with each dtype's ratio to fp32 from the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

from engine import native

CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(
    num_reqs: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """query [R, H, D], a bf16-valued fp32 cache, shuffled block tables, seq_lens."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_req = -(-context // block_size)
    num_blocks = num_reqs * blocks_per_req
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen).to(torch.bfloat16).float()
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(num_reqs, -1)
    seq_lens = torch.full((num_reqs,), context, dtype=torch.int32)
    query = torch.randn(num_reqs, num_heads, head_dim, generator=gen)
    return query, cache, tables, seq_lens


def bench(args: argparse.Namespace, context: int) -> dict[str, float]:
    query, cache32, tables, seq_lens = _inputs(
        args.num_reqs, context, args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    )
    caches = {name: cache32.to(dtype) for name, dtype in CACHE_DTYPES.items()}
    scale = args.head_dim**-0.5

    def run(cache: torch.Tensor) -> torch.Tensor:
        return native.paged_decode_attention(query, cache, tables, seq_lens, context, scale)

    outs = {name: run(cache) for name, cache in caches.items()}
    for name in ("bf16", "fp16"):  # fp16 rounds the bf16 values again: close, not equal
        torch.testing.assert_close(outs[name], outs["fp32"], atol=2e-3, rtol=2e-3)
    times: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(args.repeats):
        for name, cache in caches.items():
            start = time.perf_counter()
            run(cache)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in medians.items():
        kv_bytes = caches[name].element_size() * 2 * args.num_reqs * context
        kv_bytes *= args.num_kv_heads * args.head_dim
        print(
            f"{args.num_reqs:>4} reqs x {context:>5} ctx  {name}:  {seconds * 1e3:8.3f} ms  "
            f"({kv_bytes / seconds / 1e9:6.1f} GB/s of KV)  "
            f"fp32/{name} = {medians['fp32'] / seconds:.2f}x"
        )
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--num-reqs", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=9)  # SmolLM2-135M
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not native.native_kernels_available():
        print("native CPU kernels unavailable here (no C compiler?): nothing to time")
        return 0
    with open("/proc/cpuinfo") as cpuinfo:
        models = [line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line]
    cpu = models[0] if models else "unknown CPU"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU: {cpu}")
    for context in args.contexts:
        bench(args, context)
    return 0


if __name__ == "__main__":
    sys.exit(main())
