"""Decode speed and offline throughput of a Llama-3.1-8B-shaped model served from an INT4
(GPTQ, group 128, symmetric) checkpoint with random codes: the Triton INT4 path.

    python benchmarks/gpu/int4_decode.py                     # batch-1, batch-200, offline
    python benchmarks/gpu/int4_decode.py --workloads 128x128 1000x1000 2048x128
    python benchmarks/gpu/int4_decode.py --shape tiny --device cpu --group-size 32   # smoke

The checkpoint is written once into a temporary directory in GPTQ's layout (one safetensors
file per layer; the embedding, norms and LM head in bf16), then loaded as a user's `-GPTQ`
directory would be. Figures, as benchmarks/gpu/gpu_decode.py measures them (its functions):
the kernel/GEMM crossover the engine measured per projection shape at load
(engine/layers/crossover.py: the dequantize-GEMM kernel up to it, dequantize + cuBLAS past
it), batch-1 ms/token and the share of the copy bandwidth the weights stream at (INT4 codes,
scales and zero points, the bf16 LM head); one decode step with `--batch-requests` running
requests; offline output tok/s per ISL x OSL beside TensorRT-LLM's published FP8 table
(their FP8 weights and activations, our INT4 weights and bf16 activations). On a CPU the
projections are dequantized at load (no INT4 kernel there): the smoke run checks the wiring.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

from benchmarks.gpu.decode_timing import part_decode, timed_generate
from benchmarks.gpu.gpu_decode import add_arguments, measure_device
from benchmarks.gpu.llama8b import write_model_dir
from benchmarks.gpu.route_timing import engine_crossovers
from benchmarks.gpu.throughput_workloads import part_throughput
from engine import LLM

PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def _projection_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) per projection of one layer."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    return {
        "q_proj": (hidden, hidden),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (hidden, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def _random_int4(k: int, n: int, group_size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors of a symmetric projection: random codes, scales near 0.02 / 4.6 (a
    weight spread like a trained model's), zero points 8 stored as 7."""
    groups = k // group_size
    return {
        "qweight": torch.randint(-(2**31), 2**31, (k // 8, n), generator=gen, dtype=torch.int32),
        "qzeros": torch.full((groups, n // 8), 0x77777777, dtype=torch.int32),
        "scales": (torch.rand(groups, n, generator=gen) * 0.004 + 0.002).half(),
        "g_idx": (torch.arange(k, dtype=torch.int32) // group_size),
    }


def write_int4_model(shape: str, directory: Path, group_size: int) -> Path:
    """config.json with GPTQ's quantization_config and a random INT4 checkpoint."""
    from safetensors.torch import save_file

    write_model_dir(shape, directory)
    config = json.loads((directory / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "sym": True,
        "desc_act": False,
        "checkpoint_format": "gptq",
    }
    (directory / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    shapes = _projection_shapes(config)
    for layer in range(config["num_hidden_layers"]):
        tensors = {}
        prefix = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}.{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for module, names in PROJECTIONS.items():
            for name in names:
                k, n = shapes[name]
                for leaf, t in _random_int4(k, n, group_size, gen).items():
                    tensors[f"{prefix}.{module}.{name}.{leaf}"] = t
        save_file(tensors, directory / f"model-{layer:05d}.safetensors")
    rest = {
        "model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=gen) * 0.02).bfloat16(),
        "lm_head.weight": (torch.randn(vocab, hidden, generator=gen) * 0.02).bfloat16(),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    save_file(rest, directory / "model-rest.safetensors")
    return directory


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step reads: INT4 parts, float parameters but the input embedding."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total -= (
        model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    )
    methods = [getattr(m, "quant_method", None) for m in model.modules()]
    return total + sum(m.nbytes for m in methods if m is not None)


def decode_step_ms(
    llm: LLM, num_requests: int, prompt_len: int, tokens: int, repeats: int
) -> float:
    """One decode step with `num_requests` running: (time(1 + tokens) - time(1)) / tokens."""
    vocab = llm.llm_engine.get_model_config().vocab_size
    prompts = [
        [100 + (i * 31 + j * 7919) % (vocab - 100) for j in range(prompt_len)]
        for i in range(num_requests)
    ]
    timed_generate(llm, prompts, 1 + tokens)  # warm every batch shape
    samples = []
    for _ in range(repeats):
        short, _ = timed_generate(llm, prompts, 1)
        long, _ = timed_generate(llm, prompts, 1 + tokens)
        samples.append((long - short) / tokens * 1e3)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--batch-requests", type=int, default=200, help="the decode-step batch")
    args = parser.parse_args()
    device_name = args.device
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    peak = measure_device(device)
    results: dict[str, Any] = {**peak, "shape": args.shape, "group_size": args.group_size}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        model_dir = write_int4_model(args.shape, Path(tmp), args.group_size)
        results["write_s"] = time.perf_counter() - start
        start = time.perf_counter()
        llm = LLM(
            model=str(model_dir),
            skip_tokenizer_init=True,
            device=device_name,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30) or None,
            cuda_graph_sizes=args.cuda_graph_sizes,
        )
        results["start_s"] = time.perf_counter() - start
    weight_bytes = decode_weight_bytes(llm.llm_engine.runner.model)
    results["weight_bytes_per_token"] = weight_bytes
    results["crossovers"] = engine_crossovers(llm.llm_engine.runner.model)
    print(
        f"{args.shape} INT4 (GPTQ g{args.group_size}): {weight_bytes / 1e9:.2f} GB of decode "
        f"weights; checkpoint written in {results['write_s']:.1f} s, ready in "
        f"{results['start_s']:.1f} s",
        flush=True,
    )

    def save() -> None:
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(results, indent=2, default=str))

    if args.part in ("decode", "all"):
        results["decode"] = part_decode(llm, args, peak["copy_gbps"], weight_bytes)
        step = decode_step_ms(
            llm, args.batch_requests, args.prompt_len, args.decode_tokens, args.repeats
        )
        results["decode_step_ms"] = {str(args.batch_requests): step}
        print(f"decode step with {args.batch_requests} requests: {step:.2f} ms", flush=True)
        save()
    if args.part in ("throughput", "all"):
        results["throughput"] = {}
        part_throughput(llm, args, device, peak, results["throughput"], save)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
