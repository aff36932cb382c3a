"""Decode speed and offline throughput of a Llama-3.1-8B-shaped model, with and without CUDA graphs.

    python benchmarks/gpu/gpu_decode.py --part decode        # batch-1 ms/token, graphs vs eager
    python benchmarks/gpu/gpu_decode.py --part throughput    # offline tok/s, graphs vs eager
    python benchmarks/gpu/gpu_decode.py --workloads 128x128 2048x128 1000x1000   # ISL x OSL
    python benchmarks/gpu/gpu_decode.py --part throughput --hf-prompts 16   # + transformers
    python benchmarks/gpu/gpu_decode.py --shape tiny --device cpu --part all  # a smoke run

The model is built on the device from a config.json alone (benchmarks/gpu/llama8b.py,
`load_format="dummy"`). The engine starts as a user's does (`--kv-cache-gib 0`, the
default: the KV cache takes what the GPU has left after a profile step). One engine serves
both variants: graphs on as built, then off (the runner's graphs set aside), so both see
the same weights and the greedy tokens can be compared.

Batch-1 decode: ms per output token is the difference between a request of
`1 + decode_tokens` tokens and one of 1 token, over `decode_tokens` (prefill and start-up
cancel), the median of `--repeats`. Weight-bandwidth utilisation is the bytes a decode step
reads (every parameter except the input embedding, of which a step reads one row) per token
time, as a share of the device's measured copy bandwidth; gpt-fast reports ~69 % at batch 1.

Offline throughput, per `--workloads` ISLxOSL[xPROMPTS]: PROMPTS (or `--num-prompts`) random
prompts of ISL ids, OSL new tokens each with ignore_eos, all submitted at once (vLLM's
`bench throughput`); eager beside the graphs on the first workload (`--eager-all`: on
each). Each variant first runs the whole workload once untimed (every prefill chunk size and decode
batch size the timed runs make, so Triton's compilations and cuBLAS's choices are made),
then `--repeats` timed runs, each from an empty prefix cache; printed: min / median / max
and the spread (max - min over the median), the preemptions per run, and the roofline
bound of the run (benchmarks/gpu/roofline.py: prefill at the measured matmul rate, decode
steps at the measured copy bandwidth). For 128/128, 2048/128 and 1000/1000, TensorRT-LLM's
published Llama-3.1-8B FP8 figures are printed beside ours (their FP8, our bf16).

Why an earlier version of this script measured 14.3 s (graphs) and 13.9 s (eager) for 200 x
(1,024 in / 128 out), where a plain `LLM.generate` of the same prompts took 8.4 s, read from
the code (the GPU run to confirm it is part of scripts/gpu_check.sh, which prints the
preemptions): the script gave the engine a fixed 24 GiB KV cache, 196,608 tokens of the 8B
shape in bf16 (128 KiB per token), while the run needs 230,400 (200 x 1,152) at its end;
about 190 requests fit at once, and as their outputs grew the scheduler preempted the
latest ones and recomputed their 1,024-token prompts, and the last requests decoded in a
small batch after the others. A run with enough cache (the GPU's profiled budget: ~100 GiB
on an H200) has neither. Both variants paid it, which is why graphs did not help there.
Also, no run but the first was warmed beyond 2 prompts, and each variant was timed once;
both are fixed here (the warm-up run, three timed runs with their spread).

Start-up (seconds until `LLM(...)` returns), the first token after it, and peak GPU
memory are printed too. `--output-json` writes every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

from benchmarks.gpu.llama8b import SHAPES, write_model_dir
from benchmarks.gpu.roofline import (
    copy_bandwidth_gbps,
    matmul_tflops,
    model_figures,
    offline_bound_s,
    sync,
    trtllm_line,
)
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


def variants(llm: LLM) -> list[tuple[str, Any]]:
    """("graphs", as built) when the engine captured graphs, and ("eager", graphs set aside)."""
    graphs = llm.llm_engine.runner.cuda_graphs
    found = [("graphs", contextlib.nullcontext())] if graphs is not None else []
    return [*found, ("eager", graphs_off(llm))]


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--part", choices=["decode", "throughput", "all"], default="all")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--kv-cache-gib", type=float, default=0.0, help="0 (default): what the GPU has left"
    )
    parser.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--prompt-len", type=int, default=128, help="batch-1 decode's prompt")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each variant")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument(
        "--workloads",
        type=parse_workload,
        nargs="+",
        default=[(1024, 128, None)],
        help="ISLxOSL[xPROMPTS] (prompts: --num-prompts)",
    )
    parser.add_argument("--eager-all", action="store_true", help="eager on every workload")
    parser.add_argument("--hf-prompts", type=int, default=0, help="transformers on N prompts")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--profile-dir", default=None, help="torch.profiler tables of decode")


def measure_device(device: torch.device) -> dict:
    """The copy bandwidth and matmul rate of the device (the roofline's two ceilings)."""
    on_gpu = device.type == "cuda"
    copy_gbps = copy_bandwidth_gbps(device, 2 << 30 if on_gpu else 256 << 20)
    tflops = matmul_tflops(
        device, 8192 if on_gpu else 512, torch.bfloat16 if on_gpu else torch.float32
    )
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(
        f"{name}: device copy bandwidth {copy_gbps:.0f} GB/s (read + write), "
        f"{'bf16' if on_gpu else 'fp32'} matmul {tflops:.3g} TFLOP/s",
        flush=True,
    )
    return {"device": name, "copy_gbps": copy_gbps, "tflops": tflops}


def start_engine(args: argparse.Namespace, device_name: str) -> tuple[LLM, float, float]:
    """The engine over a dummy model directory: (llm, seconds to ready, first token s)."""
    kv_bytes = int(args.kv_cache_gib * 2**30) or None
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(args.shape, Path(tmp))
        start = time.perf_counter()
        llm = LLM(
            model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
            device=device_name, dtype=args.dtype, max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, kv_cache_memory_bytes=kv_bytes,
            cuda_graph_sizes=args.cuda_graph_sizes,
        )  # fmt: skip
        start_s = time.perf_counter() - start
        first_s, _ = timed_generate(llm, [[100] * args.prompt_len], 1)
    return llm, start_s, first_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    device_name = args.device
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    peak = measure_device(device)
    llm, start_s, first_s = start_engine(args, device_name)
    runner = llm.llm_engine.runner
    weight_bytes = decode_weight_bytes(runner.model)
    graphs = runner.cuda_graphs
    results: dict[str, Any] = {
        **peak,
        "torch": torch.__version__,
        "shape": args.shape,
        "dtype": llm.llm_engine.get_model_config().dtype,
        "weight_bytes_per_token": weight_bytes,
        "kv_cache_tokens": runner.num_blocks * runner.block_size,
        "start_s": start_s,
        "first_token_s": first_s,
        "cuda_graph_sizes": graphs.captured_sizes if graphs is not None else [],
    }
    print(
        f"{args.shape} ({results['dtype']}, {weight_bytes / 1e9:.2f} GB of decode weights): "
        f"ready in {start_s:.1f} s, first token {first_s * 1e3:.0f} ms after; KV cache of "
        f"{results['kv_cache_tokens']} tokens; CUDA graphs for "
        f"{len(results['cuda_graph_sizes'])} batch sizes",
        flush=True,
    )

    def save() -> None:  # after every part: a run cut short keeps what it measured
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(results, indent=2, default=str))

    if args.part in ("decode", "all"):
        results["decode"] = part_decode(llm, args, peak["copy_gbps"], weight_bytes)
        save()
    if args.part in ("throughput", "all"):
        results["throughput"] = {}
        part_throughput(llm, args, device, peak, results["throughput"], save)
    if device.type == "cuda":
        results["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        print(f"peak GPU memory allocated: {results['peak_gpu_gib']:.1f} GiB")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
