"""The decode step's fused kernels and the prefill attention kernel, measured (issue 42):

    python benchmarks/gpu/step_kernels.py --output-json /tmp/step_kernels.json
    python benchmarks/gpu/step_kernels.py --smoke        # tiny shapes, on a CPU too

Parts (`--part`, default all):

- `prefill`: TFLOP/s of prefill attention at B=4 chunks of 2048 tokens (Llama-3.1-8B's 32/8
  heads of 128, bf16, causal): `flash_prefill` (the triton backend's prefill launch), the
  previous `paged_attention` prefill tiles, and torch's SDPA over contiguous tensors (its
  flash kernel: the ceiling on this GPU). Each is checked against the torch reference first.
- `rope`: the rotary + KV-write work of one batch-200 decode step (32 layers), in a CUDA
  graph: the torch rotation (flip, mul, addcmul) + `write_kv_cache` before, the rotary kernel
  + `write_kv_cache`, and the fused `rotary_write_kv_cache`; plus the per-forward cos/sin.
- `profile`: a torch.profiler table of batch-200 decode steps of the engine (Llama-3.1-8B's
  shape, dummy weights, the triton backend), eager and with CUDA graphs, and the device
  kernels of one step by kind: Triton, GEMM, and what is left of aten's (elementwise, copies,
  reductions), by name and count.

With `--smoke` (or without CUDA) the shapes are tiny and the kernels run in Triton's
interpreter: the wiring, not the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

if not torch.cuda.is_available():  # before any kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.gpu.roofline import mean_ms

LLAMA = dict(num_heads=32, num_kv_heads=8, head_dim=128, num_layers=32)
TINY = dict(num_heads=4, num_kv_heads=2, head_dim=32, num_layers=2)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def time_ms(fn: Callable[[], object], iters: int) -> float:
    """Mean milliseconds per call after one warm-up call (CUDA events on a GPU)."""
    return mean_ms(fn, iters, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def part_prefill(smoke: bool, device: torch.device) -> dict[str, Any]:
    from kernels import flash_prefill, paged_attention, ref_paged_attention

    shape = TINY if smoke else LLAMA
    heads, kv_heads, head_dim = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    batch, chunk = (2, 24) if smoke else (4, 2048)
    dtype = torch.float32 if smoke else torch.bfloat16
    block_size = 16
    blocks = -(-chunk // block_size)
    kv_cache = torch.randn(2, batch * blocks, block_size, kv_heads, head_dim, device=device)
    kv_cache = kv_cache.to(dtype)
    block_tables = torch.randperm(batch * blocks, device=device).to(torch.int32)
    block_tables = block_tables.view(batch, blocks)
    seq_lens = torch.full((batch,), chunk, dtype=torch.int32, device=device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device) * chunk
    query = torch.randn(batch * chunk, heads, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    # Causal: each head of each chunk multiplies q k^T and p v over chunk(chunk + 1)/2 pairs.
    flops = 4 * batch * heads * head_dim * chunk * (chunk + 1) // 2

    def flash() -> torch.Tensor:
        return flash_prefill(
            query, kv_cache, block_tables, seq_lens, starts, max_query_len=chunk, scale=scale
        )

    def paged() -> torch.Tensor:
        return paged_attention(
            query, kv_cache, block_tables, seq_lens, starts,
            max_query_len=chunk, max_seq_len=chunk, scale=scale,
        )  # fmt: skip

    # The same keys as contiguous [B, H, L, D] tensors for SDPA, expanded to every query head
    # (its flash kernel, the ceiling, takes no GQA layout).
    positions = torch.arange(chunk, device=device)
    flat = block_tables[:, positions // block_size].long()  # [B, L]
    group = heads // kv_heads
    keys = kv_cache[0, flat, positions % block_size].transpose(1, 2)  # [B, Hkv, L, D]
    keys = keys.repeat_interleave(group, dim=1).contiguous()
    values = kv_cache[1, flat, positions % block_size].transpose(1, 2)
    values = values.repeat_interleave(group, dim=1).contiguous()
    q_bhld = query.view(batch, chunk, heads, head_dim).transpose(1, 2).contiguous()

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q_bhld, keys, values, is_causal=True, scale=scale
        )

    want = ref_paged_attention(query, kv_cache, block_tables, seq_lens, starts, scale)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    results: dict[str, Any] = {"batch": batch, "chunk": chunk, "dtype": str(dtype)}
    for name, fn in (("flash_prefill", flash), ("paged_attention", paged), ("sdpa", sdpa)):
        got = fn()
        if name == "sdpa":
            got = got.transpose(1, 2).reshape(query.shape)
        error = (got.float() - want.float()).abs().max().item()
        ms = time_ms(fn, 2 if smoke else 20)
        tflops = flops / (ms * 1e-3) / 1e12
        results[name] = {"ms": ms, "tflops": tflops, "max_abs_error": error}
        status = "ok" if error <= tol else f"WRONG (max error {error:.3g})"
        print(
            f"prefill attention B={batch} chunk={chunk} [{name:>15}]: {ms:8.3f} ms "
            f"{tflops:7.1f} TFLOP/s ({status})",
            flush=True,
        )
    return results


def part_rope(smoke: bool, device: torch.device) -> dict[str, Any]:
    """Rotary + KV write of one decode step over every layer, timed as a CUDA graph replays
    it (launch costs as in graph-mode decode); eager on a CPU."""
    from engine.layers.ops import apply_rotary_emb
    from engine.layers.rope import RotaryEmbedding
    from kernels import rotary_cos_sin_, rotary_write_kv_cache, write_kv_cache

    shape = TINY if smoke else LLAMA
    heads, kv_heads, head_dim = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    layers, tokens = shape["num_layers"], (8 if smoke else 200)
    dtype = torch.float32 if smoke else torch.bfloat16
    max_pos = 256 if smoke else 8192
    positions = torch.randint(0, max_pos, (tokens,), device=device)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, device=device).to(dtype)
    num_blocks = tokens * 2
    kv_cache = torch.zeros(2, num_blocks, 16, kv_heads, head_dim, device=device, dtype=dtype)
    slots = torch.randperm(num_blocks * 16, device=device)[:tokens]
    rotary = {impl: RotaryEmbedding(head_dim, max_pos, 500000.0, LLAMA3_ROPE, impl) for impl in
              ("torch", "triton")}  # fmt: skip
    cos, sin = rotary["triton"].cos_sin(positions, dtype)
    qk, value = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :]

    def torch_rotation() -> None:
        for _ in range(layers):
            rotated = apply_rotary_emb(qk, cos, sin)
            write_kv_cache(rotated[:, heads:], value, kv_cache, slots)

    def kernel_then_write() -> None:
        for _ in range(layers):
            rotary_cos_sin_(qk, cos, sin)
            write_kv_cache(qk[:, heads:], value, kv_cache, slots)

    def fused() -> None:
        for _ in range(layers):
            rotary_write_kv_cache(qk, value, cos, sin, kv_cache, slots, heads)

    def cos_sin(impl: str) -> Callable[[], object]:
        return lambda: rotary[impl].cos_sin(positions, dtype)

    cases = {
        "torch rotation + write_kv_cache": torch_rotation,
        "rotary kernel + write_kv_cache": kernel_then_write,
        "rotary_write_kv_cache (fused)": fused,
        "cos_sin per forward, torch": cos_sin("torch"),
        "cos_sin per forward, triton": cos_sin("triton"),
    }
    results: dict[str, Any] = {"tokens": tokens, "layers": layers}
    for name, fn in cases.items():
        run = fn
        if device.type == "cuda":
            fn()  # compile and build the tables outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run = graph.replay
        us = time_ms(run, 2 if smoke else 200) * 1e3
        results[name] = us
        print(f"decode step, {tokens} tokens x {layers} layers [{name:>32}]: {us:9.1f} us")
    return results


def _kernel_kind(name: str) -> str:
    lowered = name.lower()
    if any(m in lowered for m in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "splitk")):
        return "gemm"
    if name.startswith("_") or "triton" in lowered:
        return "triton"
    return "aten"


def part_profile(smoke: bool, device: torch.device, directory: Path) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu.decode_timing import graphs_off
    from benchmarks.gpu.llama8b import write_model_dir
    from engine import LLM, SamplingParams

    batch = 8 if smoke else 200
    steps = 2 if smoke else 4
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir("tiny" if smoke else "llama-3.1-8b", Path(tmp))
        llm = LLM(
            model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
            device=device.type, attention_backend="triton", max_model_len=1024,
            max_num_seqs=256, max_num_batched_tokens=4096,
            kv_cache_memory_bytes=(64 << 20) if smoke else (8 << 30),
        )  # fmt: skip
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": [100 + i % 50] * 16}, params)
    seen: set[str] = set()
    while len(seen) < batch:  # every request past its prefill: the steps are pure decode
        seen.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    engine.step()
    directory.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    results: dict[str, Any] = {"batch": batch, "steps": steps}
    for name, eager in (("eager", True), ("graphs", False)):
        if name == "graphs" and engine.runner.cuda_graphs is None:
            continue
        context = graphs_off(llm) if eager else _nothing()
        with context:
            engine.step()
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    engine.step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
        sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=50)
        (directory / f"decode_batch{batch}_{name}.txt").write_text(table)
        results[name] = _summarize(prof, device, steps)
        kinds = results[name]["per_step_by_kind"]
        print(f"batch-{batch} decode step [{name}]: " + ", ".join(
            f"{kind} {v['count']:.0f} kernels {v['us']:.0f} us" for kind, v in kinds.items()
        ))  # fmt: skip
        for kernel, v in results[name]["aten"].items():
            print(f"    aten left [{name}]: {v['count']:5.1f}/step {v['us']:8.1f} us  {kernel}")
    for request_id in map(str, range(batch)):
        engine.abort_request(request_id)
    return results


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _summarize(prof: Any, device: torch.device, steps: int) -> dict[str, Any]:
    """Device kernels per step by kind (CUDA), and the aten ones by name; on a CPU the aten
    ops by name (no device kernels exist there)."""
    by_kind: dict[str, dict[str, float]] = {}
    aten: dict[str, dict[str, float]] = {}
    for event in prof.key_averages():
        if device.type == "cuda":
            us = event.self_device_time_total
            if us <= 0 or event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            kind = _kernel_kind(event.key)
        else:
            if not event.key.startswith("aten::") or event.self_cpu_time_total <= 0:
                continue
            us, kind = event.self_cpu_time_total, "aten"
        entry = by_kind.setdefault(kind, {"count": 0.0, "us": 0.0})
        entry["count"] += event.count / steps
        entry["us"] += us / steps
        if kind == "aten":
            aten[event.key[:120]] = {"count": event.count / steps, "us": us / steps}
    ranked = dict(sorted(aten.items(), key=lambda kv: -kv[1]["us"])[:25])
    return {"per_step_by_kind": by_kind, "aten": ranked}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["prefill", "rope", "profile", "all"], default="all")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (any machine)")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--profile-dir", default="/tmp/step_kernels_profile")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    smoke = args.smoke or device.type != "cuda"
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    results: dict[str, Any] = {"device": name, "smoke": smoke, "torch": torch.__version__}
    print(f"{name}{' (smoke shapes)' if smoke else ''}", flush=True)

    def save() -> None:
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(results, indent=2, default=str))

    if args.part in ("prefill", "all"):
        results["prefill"] = part_prefill(smoke, device)
        save()
    if args.part in ("rope", "all"):
        results["rope"] = part_rope(smoke, device)
        save()
    if args.part in ("profile", "all"):
        results["profile"] = part_profile(smoke, device, Path(args.profile_dir))
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
