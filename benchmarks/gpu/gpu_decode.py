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
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

from benchmarks.gpu.decode_timing import decode_weight_bytes, part_decode, timed_generate
from benchmarks.gpu.llama8b import SHAPES, write_model_dir
from benchmarks.gpu.roofline import copy_bandwidth_gbps, matmul_tflops
from benchmarks.gpu.throughput_workloads import parse_workload, part_throughput
from engine import LLM


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
