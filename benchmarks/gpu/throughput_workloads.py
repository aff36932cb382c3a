"""Offline throughput of ISLxOSL workloads on a GPU benchmark's engine, graphs vs eager,
against the roofline bound and published figures, and transformers' `generate` on the same
prompts (benchmarks/gpu/gpu_decode.py's throughput part; the FP8 and INT4 decode
benchmarks use it too).

Per workload: a warm-up run of the whole workload, then `--repeats` timed runs from an empty
prefix cache (min / median / max, spread, preemptions per run).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.gpu.decode_timing import timed_generate, variants
from benchmarks.gpu.llama8b import SHAPES
from benchmarks.gpu.roofline import model_figures, offline_bound_s, sync, trtllm_line
from engine import LLM


def parse_workload(text: str) -> tuple[int, int, int | None]:
    """`1024x128` -> (ISL, OSL, None: --num-prompts); `1024x128x200` -> 200 prompts."""
    parts = text.split("x")
    if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"a workload is ISLxOSL or ISLxOSLxPROMPTS, e.g. 1024x128x200; got {text!r}"
        )
    isl, osl, *count = (int(p) for p in parts)
    return isl, osl, count[0] if count else None


def preemptions(llm: LLM) -> float:
    return llm.llm_engine.metrics.num_preemptions._value.get()


def timed_runs(llm: LLM, prompts: list[list[int]], osl: int, repeats: int) -> dict:
    """One untimed run of the whole workload (every shape the timed runs use), then
    `repeats` timed ones; seconds of each, their spread, the preemptions per run."""
    timed_generate(llm, prompts, osl)
    seconds, preempted = [], []
    for _ in range(repeats):
        before = preemptions(llm)
        elapsed, _ = timed_generate(llm, prompts, osl)
        seconds.append(elapsed)
        preempted.append(preemptions(llm) - before)
    median = statistics.median(seconds)
    return {
        "runs_s": seconds,
        "min_s": min(seconds),
        "median_s": median,
        "max_s": max(seconds),
        "spread": (max(seconds) - min(seconds)) / median,
        "preemptions_per_run": preempted,
    }


def part_throughput(
    llm: LLM,
    args: argparse.Namespace,
    device: torch.device,
    peak: dict,
    results: dict[str, Any],
    on_progress: Any = None,
) -> dict:
    """Each workload's runs into `results`; `on_progress()` after each (the caller saves
    what it has)."""
    from benchmarks.offline.throughput import make_prompts

    model_config = llm.llm_engine.get_model_config()
    runner = llm.llm_engine.runner
    figures = model_figures(model_config.hf_config, runner.dtype, runner.kv_cache_dtype)
    max_num_seqs = llm.llm_engine.get_scheduler_config().max_num_seqs
    for index, (isl, osl, count) in enumerate(args.workloads):
        prompts = make_prompts(count or args.num_prompts, isl, model_config.vocab_size, seed=0)
        n_out = len(prompts) * osl
        bound = offline_bound_s(
            figures, len(prompts), isl, osl, max_num_seqs, peak["tflops"], peak["copy_gbps"]
        )
        label = f"offline {len(prompts)} x ({isl} in, {osl} out)"
        workload: dict[str, Any] = {"num_prompts": len(prompts), "bound": bound}
        # eager beside the graphs on the first workload (and every one with --eager-all)
        for name, context in variants(llm)[: None if index == 0 or args.eager_all else 1]:
            with context:
                runs = timed_runs(llm, prompts, osl, args.repeats)
            runs["output_tok_s"] = n_out / runs["median_s"]
            runs["total_tok_s"] = len(prompts) * (isl + osl) / runs["median_s"]
            workload[name] = runs
            print(
                f"{label} [{name:>6}]: {runs['output_tok_s']:9.1f} output tok/s, "
                f"{runs['total_tok_s']:9.1f} total tok/s; s min {runs['min_s']:.2f} / median "
                f"{runs['median_s']:.2f} / max {runs['max_s']:.2f} (spread "
                f"{100 * runs['spread']:.1f} %), preemptions {runs['preemptions_per_run']}",
                flush=True,
            )
        best = min(r["median_s"] for k, r in workload.items() if k in ("graphs", "eager"))
        print(
            f"  roofline bound {bound['total_s']:.2f} s (prefill {bound['prefill_s']:.2f} s at "
            f"{peak['tflops']:.3g} TFLOP/s, decode {bound['decode_s']:.2f} s at "
            f"{peak['copy_gbps']:.0f} GB/s): the best median is {best / bound['total_s']:.2f}x "
            "the bound",
            flush=True,
        )
        if args.shape == "llama-3.1-8b" and (
            line := trtllm_line(
                peak["device"], isl, osl, n_out / best, getattr(args, "weights_label", "bf16")
            )
        ):
            print(line, flush=True)
        results[f"{isl}x{osl}"] = workload
        if on_progress is not None:
            on_progress()
    if args.hf_prompts:
        isl, osl, _ = args.workloads[0]
        prompts = make_prompts(args.hf_prompts, isl, model_config.vocab_size, seed=0)
        results["transformers"] = hf_generate(llm, args, prompts, osl, device)
    return results


def hf_generate(
    llm: LLM, args: argparse.Namespace, prompts: list[list[int]], osl: int, device
) -> dict:
    """transformers `generate` on the same shape (its own random weights: speed only), one
    batch of `prompts`, against ours on the same prompts. Ours runs first; then the engine
    sleeps at level 1 (its cache freed, its weights in host memory: the profiled cache
    leaves no room for a second 8B model on the device) and wakes up after."""
    from transformers import LlamaConfig, LlamaForCausalLM

    timed_generate(llm, prompts, osl)  # warm, as the transformers run is
    ours_s, _ = timed_generate(llm, prompts, osl)
    llm.sleep(level=1)
    config = LlamaConfig(**SHAPES[args.shape])  # the shape's own vocabulary
    dtype = getattr(torch, llm.llm_engine.get_model_config().dtype)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype).eval()
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    kwargs = dict(do_sample=False, max_new_tokens=osl, min_new_tokens=osl)
    with torch.inference_mode():
        model.generate(input_ids=ids[:1], max_new_tokens=2, min_new_tokens=2)  # warm-up
        sync(device)
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        sync(device)
        hf_s = time.perf_counter() - start
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    llm.wake_up()
    n = len(prompts) * osl
    print(
        f"transformers generate, {len(prompts)} prompts in one batch: {n / hf_s:9.1f} output "
        f"tok/s; ours on the same: {n / ours_s:9.1f} ({hf_s / ours_s:.2f}x)",
        flush=True,
    )
    return {"hf_output_tok_s": n / hf_s, "ours_output_tok_s": n / ours_s}
