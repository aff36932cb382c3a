"""Timing the engine's `generate` on a GPU benchmark's model, CUDA graphs on and off, and
batch-1 decode in ms per token (benchmarks/gpu/gpu_decode.py's decode part; the FP8 and INT4
decode benchmarks use it too).

Batch-1 decode: ms per output token is the difference between a request of
`1 + decode_tokens` tokens and one of 1 token, over `decode_tokens` (prefill and start-up
cancel), the median of `--repeats`; the weight bandwidth is the bytes a decode step reads
per token time, as a share of the device's measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine import LLM, SamplingParams


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters one decode step reads: all but the input embedding (one row
    of it, negligible); a tied lm_head is the embedding and is read whole."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    tied = getattr(model, "lm_head", None) is None
    return total if tied else total - embed.numel() * embed.element_size()


@contextlib.contextmanager
def graphs_off(llm: LLM) -> Iterator[None]:
    """Every step eager, as with enforce_eager, on the same engine and weights."""
    runner = llm.llm_engine.runner
    graphs, runner.cuda_graphs = runner.cuda_graphs, None
    try:
        yield
    finally:
        runner.cuda_graphs = graphs


def variants(llm: LLM) -> list[tuple[str, Any]]:
    """("graphs", as built) when the engine captured graphs, and ("eager", graphs set aside)."""
    graphs = llm.llm_engine.runner.cuda_graphs
    found = [("graphs", contextlib.nullcontext())] if graphs is not None else []
    return [*found, ("eager", graphs_off(llm))]


def timed_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.llm_engine.reset_prefix_cache()  # every run prefills: repeats must not hit the cache
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    return elapsed, [list(o.outputs[0].token_ids) for o in outputs]


def decode_ms_per_token(llm: LLM, prompt: list[int], tokens: int, repeats: int) -> dict:
    """Median over `repeats` of (time(1 + tokens) - time(1)) / tokens, and the tokens."""
    timed_generate(llm, [prompt], 1 + tokens)  # every shape of the timed runs, once
    samples = []
    for _ in range(repeats):
        short, _ = timed_generate(llm, [prompt], 1)
        long, out = timed_generate(llm, [prompt], 1 + tokens)
        samples.append((long - short) / tokens * 1e3)
    return {"ms_per_token": statistics.median(samples), "samples": samples, "tokens": out[0]}


def part_decode(llm: LLM, args: argparse.Namespace, copy_gbps: float, weight_bytes: int) -> dict:
    vocab = llm.llm_engine.get_model_config().vocab_size
    prompt = [100 + (i * 7919) % (vocab - 100) for i in range(args.prompt_len)]
    results = {}
    for name, context in variants(llm):
        with context:
            result = decode_ms_per_token(llm, prompt, args.decode_tokens, args.repeats)
        ms = result["ms_per_token"]
        gbps = weight_bytes / (ms * 1e-3) / 1e9
        result.update(weight_gbps=gbps, share_of_copy=gbps / copy_gbps)
        print(
            f"batch-1 decode [{name:>6}]: {ms:7.3f} ms/token ({1e3 / ms:7.1f} tok/s), weights "
            f"{gbps:7.0f} GB/s = {100 * gbps / copy_gbps:5.1f} % of the copy bandwidth",
            flush=True,
        )
        results[name] = result
    if args.profile_dir:
        profile_decode(llm, prompt, Path(args.profile_dir))
    if "graphs" in results:
        same = results["graphs"]["tokens"] == results["eager"]["tokens"]
        print(f"batch-1 greedy tokens, graphs vs eager: {'the same' if same else 'DIFFER'}")
        results["same_tokens"] = same
    for result in results.values():
        if isinstance(result, dict):
            result.pop("tokens", None)
    return results


def profile_decode(llm: LLM, prompt: list[int], directory: Path) -> None:
    """torch.profiler tables of 16 batch-1 decode steps, eager and with graphs: where a
    step's time goes (kernels by device time; the host's share shows in the eager table)."""
    from torch.profiler import ProfilerActivity, profile

    directory.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    for name, context in variants(llm):
        with context:
            timed_generate(llm, [prompt], 17)  # warm
            with profile(activities=activities) as prof:
                timed_generate(llm, [prompt], 17)
        sort = "self_device_time_total" if len(activities) > 1 else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40)
        (directory / f"decode_profile_{name}.txt").write_text(table)
        print(f"profile of 16 decode steps [{name}] -> {directory}/decode_profile_{name}.txt")
