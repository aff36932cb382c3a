"""What a run of the GPU benchmarks could take at best on this device, and published figures.

Measured here, on the device of the run:
- `copy_bandwidth_gbps`: bytes read + written per second by a device-to-device copy;
- `matmul_tflops`: a large bf16 (fp32 on the CPU) matmul's rate, the ceiling of prefill.

Bounds (`offline_bound_s`) for an offline run of n prompts (ISL in, OSL out), the engine at
most `max_num_seqs` requests at a time: prefill is compute (2 x parameters + attention per
token, over the matmul rate); each decode step reads the weights and every running
request's KV cache (over the copy bandwidth) or computes its tokens, whichever is longer.
Real engines reach a fraction of these; the bound says how far a figure is from the device.

TensorRT-LLM publishes Llama-3.1-8B throughput in FP8 on one GPU (its performance overview,
`trtllm-bench`, output tokens/s); we run bf16, with twice the bytes per weight, so these
are a reference of what the hardware does with the best kernels and half the bytes, not a
like-for-like comparison.
"""

from __future__ import annotations

import math
import time

import torch

# (ISL, OSL) -> output tok/s, Llama-3.1-8B FP8, TensorRT-LLM's published table.
TRTLLM_FP8_OUTPUT_TOK_S = {
    (128, 128): {"H200": 27_911, "H100": 28_312},
    (2048, 128): {"H200": 3_538, "H100": 3_450},
    (1000, 1000): {"H200": 17_744, "H100": 15_220},
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mean_ms(fn, iters: int, device: torch.device) -> float:
    """Mean milliseconds per call of `iters` calls after one warm-up call: CUDA events on a
    GPU, the host clock elsewhere (smoke runs: the figure only says the wiring runs)."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters * 1e3
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) / iters


def _best_of(fn, device: torch.device, repeats: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth_gbps(device: torch.device, num_bytes: int) -> float:
    """Bytes read + written per second by a device-to-device copy (the best of 10)."""
    src = torch.empty(num_bytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    seconds = _best_of(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def matmul_tflops(device: torch.device, n: int, dtype: torch.dtype) -> float:
    """The rate of an n x n x n matmul (the best of 10): the device's practical peak."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _best_of(lambda: a @ b, device)
    return 2 * n**3 / seconds / 1e12


def model_figures(hf_config, dtype: torch.dtype, kv_dtype: torch.dtype) -> dict:
    """Parameters (without the input embedding: a step reads one row of it), bytes of
    weights a decode step reads, KV bytes per token, attention width."""
    h, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    inter, vocab = hf_config.intermediate_size, hf_config.vocab_size
    per_layer = h * head_dim * (heads + 2 * kv_heads) + heads * head_dim * h + 3 * h * inter
    params = layers * per_layer + vocab * h  # + the LM head
    return {
        "params": params,
        "weight_bytes": params * dtype.itemsize,
        "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * kv_dtype.itemsize,
        "attn_width": layers * heads * head_dim,
    }


def offline_bound_s(
    figures: dict, n: int, isl: int, osl: int, max_num_seqs: int, tflops: float, gbps: float
) -> dict:
    """Lower bounds of an offline run's prefill and decode seconds (see the module doc)."""
    flops_per_prompt = 2 * figures["params"] * isl + 2 * figures["attn_width"] * isl * isl
    prefill_s = n * flops_per_prompt / (tflops * 1e12)
    decode_s = 0.0
    for wave in range(math.ceil(n / max_num_seqs)):
        batch = min(max_num_seqs, n - wave * max_num_seqs)
        for t in range(osl - 1):  # the first token comes with the prefill
            kv = batch * (isl + t) * figures["kv_bytes_per_token"]
            memory_s = (figures["weight_bytes"] + kv) / (gbps * 1e9)
            compute_s = batch * 2 * figures["params"] / (tflops * 1e12)
            decode_s += max(memory_s, compute_s)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "total_s": prefill_s + decode_s}


def trtllm_line(
    device_name: str, isl: int, osl: int, ours_tok_s: float, ours: str = "bf16"
) -> str | None:
    """Ours (`ours`: our weights' type) against TensorRT-LLM's published FP8 figure for this
    ISL/OSL pair, on the published GPU this device is (H200 or H100; both printed otherwise)."""
    table = TRTLLM_FP8_OUTPUT_TOK_S.get((isl, osl))
    if table is None:
        return None
    gpus = [g for g in table if g in device_name] or list(table)
    parts = [
        f"{g} {table[g]:,} ({ours_tok_s / table[g]:.2f}x)" for g in gpus
    ]  # fmt: skip
    return (
        f"  TensorRT-LLM's published Llama-3.1-8B FP8 for {isl}/{osl}: {', '.join(parts)} "
        f"output tok/s: their FP8 against our {ours}"
    )
