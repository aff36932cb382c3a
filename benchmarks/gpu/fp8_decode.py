"""Llama-3.1-8B's shape in FP8 (compressed-tensors FP8_DYNAMIC, random weights) on a GPU.

    python benchmarks/gpu/fp8_decode.py                       # everything, 8B shape
    python benchmarks/gpu/fp8_decode.py --workloads 128x128x200 --batch 200
    python benchmarks/gpu/fp8_decode.py --shape tiny --device cpu --fp8-compute fp8  # smoke

The model directory is a config.json with the `quantization_config` llm-compressor writes
for FP8_DYNAMIC (per-channel FP8 weights, activations quantized per token); the weights are
drawn on the device (`load_format="dummy"`, engine/loader/dummy_weights.py), so the FP8
projections run as a served checkpoint's do: `Fp8LinearMethod` (engine/layers/fp8_linear.py)
on sm_89+, dequantized at load elsewhere (`--fp8-compute fp8` forces the FP8 path, e.g.
on the CPU for a smoke run).

Printed, with benchmarks/gpu/gpu_decode.py's measurements:
- the kernel/GEMM crossover the engine measured per projection shape at load
  (engine/layers/crossover.py: up to it the FP8 GEMV of kernels/fp8_gemv.py, past it
  quantize + `_scaled_mm`);
- batch-1 decode ms/token and its weight bandwidth as a share of the copy bandwidth
  (goal on an H200: <= 2.4 ms/token), then the same with `_scaled_mm` at every row count
  (`--no-gemv-baseline` skips it): the GEMV's gain;
- one decode step at `--batch` requests (ms per step: the difference between runs of
  1 + N and 1 new tokens over N);
- offline output tok/s per workload beside TensorRT-LLM's published FP8 table (goal: >=
  0.8x of it; H200: 27,911 / 17,744 / 3,538 for 128/128, 1000/1000, 2048/128).
The roofline bound printed by the throughput part counts weights at the model dtype's
width, so it is loose (about 2x) for FP8 weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

from benchmarks.gpu.decode_timing import decode_weight_bytes, part_decode, timed_generate
from benchmarks.gpu.gpu_decode import add_arguments, measure_device
from benchmarks.gpu.llama8b import write_model_dir
from benchmarks.gpu.route_timing import engine_crossovers, with_kernel_rows
from benchmarks.gpu.throughput_workloads import part_throughput
from engine import LLM

H200_BATCH1_GOAL_MS = 2.4
TRTLLM_SHARE_GOAL = 0.8
# llm-compressor's FP8_DYNAMIC scheme as its checkpoints' config.json states it.
FP8_DYNAMIC_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                        "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "symmetric": True, "dynamic": True},
        }
    },
    "ignore": ["lm_head"],
}  # fmt: skip


def write_fp8_model_dir(shape: str, directory: Path) -> Path:
    write_model_dir(shape, directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = FP8_DYNAMIC_CONFIG
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def decode_step_ms(llm: LLM, batch: int, prompt_len: int, tokens: int) -> float:
    """ms of one decode step with `batch` requests running: (time of 1 + tokens new tokens
    - time of 1) / tokens, each run on `batch` prompts at once (warmed first)."""
    vocab = llm.llm_engine.get_model_config().vocab_size
    prompts = [
        [100 + (i * 31 + j * 7) % (vocab - 100) for j in range(prompt_len)] for i in range(batch)
    ]
    timed_generate(llm, prompts, 1 + tokens)
    short, _ = timed_generate(llm, prompts, 1)
    long, _ = timed_generate(llm, prompts, 1 + tokens)
    return (long - short) / tokens * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--batch", type=int, default=200, help="the decode step's batch")
    parser.add_argument("--fp8-compute", choices=["auto", "fp8", "dequantize"], default="auto")
    parser.add_argument(
        "--no-gemv-baseline", action="store_true", help="skip batch-1 with _scaled_mm only"
    )
    parser.set_defaults(workloads=[(128, 128, None), (1000, 1000, None), (2048, 128, None)])
    args = parser.parse_args()
    args.weights_label = "FP8"  # how part_throughput names ours beside TensorRT-LLM's
    os.environ["PAGEDSERVE_FP8_COMPUTE"] = args.fp8_compute
    device_name = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    device = torch.device(device_name)
    peak = measure_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_fp8_model_dir(args.shape, Path(tmp))
        start = time.perf_counter()
        llm = LLM(
            model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
            device=device_name, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30) or None,
            cuda_graph_sizes=args.cuda_graph_sizes,
        )  # fmt: skip
        start_s = time.perf_counter() - start
    runner = llm.llm_engine.runner
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    weight_bytes = decode_weight_bytes(runner.model)
    results: dict[str, Any] = {
        **peak, "shape": args.shape, "weight_dtype": str(qkv.weight.dtype),
        "weight_bytes_per_token": weight_bytes, "start_s": start_s,
    }  # fmt: skip
    print(
        f"{args.shape} FP8 (projections stored {qkv.weight.dtype}, {weight_bytes / 1e9:.2f} GB "
        f"of decode weights): ready in {start_s:.1f} s",
        flush=True,
    )

    def save() -> None:
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(results, indent=2, default=str))

    results["crossovers"] = crossovers = engine_crossovers(runner.model)
    if args.part in ("decode", "all"):
        results["decode"] = part_decode(llm, args, peak["copy_gbps"], weight_bytes)
        if any(crossovers.values()) and not args.no_gemv_baseline:
            print("batch-1 decode with _scaled_mm at every row count (the GEMV off):")
            with_kernel_rows(runner, 0)
            results["decode_scaled_mm"] = part_decode(llm, args, peak["copy_gbps"], weight_bytes)
            with_kernel_rows(runner, crossovers)
        best = min(r["ms_per_token"] for r in results["decode"].values() if isinstance(r, dict))
        if "H200" in peak["device"]:
            verdict = "met" if best <= H200_BATCH1_GOAL_MS else "NOT met"
            print(f"batch-1 FP8 goal <= {H200_BATCH1_GOAL_MS} ms/token on an H200: {verdict}")
        step_ms = decode_step_ms(llm, args.batch, args.prompt_len, max(2, args.decode_tokens // 8))
        results["decode_step_ms"] = {str(args.batch): step_ms}
        rate = args.batch * 1e3 / step_ms
        print(f"decode step at batch {args.batch}: {step_ms:.2f} ms ({rate:.0f} tok/s)")
        save()
    if args.part in ("throughput", "all"):
        results["throughput"] = {}
        part_throughput(llm, args, device, peak, results["throughput"], save)
        print(f"goal: >= {TRTLLM_SHARE_GOAL}x TensorRT-LLM's FP8 output tok/s on each workload")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
