"""Decode speed and offline throughput of a Llama-3.1-8B-shaped model, with and without CUDA graphs.

    python benchmarks/gpu/gpu_decode.py --part decode          # batch-1 ms/token, graphs vs eager
    python benchmarks/gpu/gpu_decode.py --part throughput      # offline tok/s, graphs vs eager
    python benchmarks/gpu/gpu_decode.py --part throughput --hf-prompts 16   # + transformers
    python benchmarks/gpu/gpu_decode.py --shape tiny --device cpu --part all  # a smoke run

The model is built on the device from a config.json alone (`load_format="dummy"`: random
weights, the real model's shapes and dtype, no hub, no 16 GB of files). One engine serves
both variants: graphs on as built, then off (the runner's graphs set aside), so both see the
same weights and the greedy tokens can be compared.

Batch-1 decode: ms per output token is the difference between a request of
`1 + decode_tokens` tokens and one of 1 token, over `decode_tokens` (prefill and start-up
cancel). Weight-bandwidth utilisation is the bytes of weights a decode step reads (every
parameter except the input embedding, of which a step reads one row) per token time, as a
share of the device's measured copy bandwidth (bytes read + written by a device-to-device
copy); gpt-fast reports ~69 % at batch 1, the issue's goal is >= 75 %.

Offline throughput: `--num-prompts` random prompts of `--input-len` ids, `--output-len` new
tokens each with ignore_eos, all submitted at once (vLLM's `bench throughput`). The figures
published for this shape on one H100 in bf16 (1,000 prompts of 1,024 in / 128 out) are
vLLM ~12.5k and SGLang ~16k output tokens/s. `--hf-prompts N` also runs transformers
`generate` on the first N prompts (one batch) and ours on the same N.

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

import torch

from engine import LLM, SamplingParams

SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B's config.json (shapes, rope and vocabulary)
    "llama-3.1-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    # a smoke-test shape (CPU, or a quick check of the script on a GPU)
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
}  # fmt: skip
PUBLISHED_8B_H100_OUTPUT_TOK_S = {"vLLM": 12_500, "SGLang": 16_000}


def write_config(shape: str, directory: Path) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(**SHAPES[shape]).save_pretrained(directory)
    return directory


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gbps(device: torch.device, num_bytes: int) -> float:
    """Bytes read + written per second by a device-to-device copy (the best of 10)."""
    src = torch.empty(num_bytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(10):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best / 1e9


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
    graphs = llm.llm_engine.runner.cuda_graphs
    variants = [("graphs", contextlib.nullcontext())] if graphs is not None else []
    variants.append(("eager", graphs_off(llm)))
    for name, context in variants:
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
    graphs = llm.llm_engine.runner.cuda_graphs
    variants = [("graphs", contextlib.nullcontext())] if graphs is not None else []
    variants.append(("eager", graphs_off(llm)))
    for name, context in variants:
        with context:
            timed_generate(llm, [prompt], 17)  # warm
            with profile(activities=activities) as prof:
                timed_generate(llm, [prompt], 17)
        sort = "self_device_time_total" if len(activities) > 1 else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40)
        (directory / f"decode_profile_{name}.txt").write_text(table)
        print(f"profile of 16 decode steps [{name}] -> {directory}/decode_profile_{name}.txt")


def part_throughput(llm: LLM, args: argparse.Namespace, device: torch.device) -> dict:
    from benchmarks.offline.throughput import make_prompts

    vocab = llm.llm_engine.get_model_config().vocab_size
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, seed=0)
    timed_generate(llm, prompts[:2], 4)  # any first-use cost out of the timing
    results: dict[str, Any] = {}
    graphs = llm.llm_engine.runner.cuda_graphs
    variants = [("graphs", contextlib.nullcontext())] if graphs is not None else []
    variants.append(("eager", graphs_off(llm)))
    for name, context in variants:
        with context:
            elapsed, _ = timed_generate(llm, prompts, args.output_len)
        out_tok_s = len(prompts) * args.output_len / elapsed
        total_tok_s = len(prompts) * (args.input_len + args.output_len) / elapsed
        results[name] = {
            "elapsed_s": elapsed,
            "output_tok_s": out_tok_s,
            "total_tok_s": total_tok_s,
        }
        print(
            f"offline {len(prompts)} x ({args.input_len} in, {args.output_len} out) [{name:>6}]: "
            f"{out_tok_s:9.1f} output tok/s, {total_tok_s:9.1f} total tok/s ({elapsed:.1f} s)",
            flush=True,
        )
    if args.shape == "llama-3.1-8b":
        best = max(r["output_tok_s"] for r in results.values())
        for system, figure in PUBLISHED_8B_H100_OUTPUT_TOK_S.items():
            print(f"  against {system}'s published ~{figure} output tok/s: {best / figure:.2f}x")
    if args.hf_prompts:
        results["transformers"] = hf_generate(llm, args, prompts[: args.hf_prompts], device)
    return results


def hf_generate(llm: LLM, args: argparse.Namespace, prompts: list[list[int]], device) -> dict:
    """transformers `generate` on the same shape (its own random weights: speed only), one
    batch of `prompts`, against ours on the same prompts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[args.shape])
    dtype = getattr(torch, llm.llm_engine.get_model_config().dtype)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype).eval()
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    kwargs = dict(do_sample=False, max_new_tokens=args.output_len, min_new_tokens=args.output_len)
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
    ours_s, _ = timed_generate(llm, prompts, args.output_len)
    n = len(prompts) * args.output_len
    print(
        f"transformers generate, {len(prompts)} prompts in one batch: {n / hf_s:9.1f} output "
        f"tok/s; ours on the same: {n / ours_s:9.1f} ({hf_s / ours_s:.2f}x)",
        flush=True,
    )
    return {"hf_output_tok_s": n / hf_s, "ours_output_tok_s": n / ours_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--part", choices=["decode", "throughput", "all"], default="all")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-gib", type=float, default=24.0, help="0: profile the GPU")
    parser.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--prompt-len", type=int, default=128, help="batch-1 decode's prompt")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-prompts", type=int, default=0, help="transformers on N prompts")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--profile-dir", default=None, help="torch.profiler tables of decode")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/offline/throughput.py
    device_name = args.device
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    copy_gbps = copy_bandwidth_gbps(device, 2 << 30 if device.type == "cuda" else 256 << 20)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{where}: device copy bandwidth {copy_gbps:.0f} GB/s (read + write)", flush=True)
    kv_bytes = int(args.kv_cache_gib * 2**30) or None
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(args.shape, Path(tmp))
        start = time.perf_counter()
        llm = LLM(
            model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
            device=device_name, dtype=args.dtype, max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, kv_cache_memory_bytes=kv_bytes,
            cuda_graph_sizes=args.cuda_graph_sizes,
        )  # fmt: skip
        start_s = time.perf_counter() - start
        first_s, _ = timed_generate(llm, [[100] * args.prompt_len], 1)
    runner = llm.llm_engine.runner
    weight_bytes = decode_weight_bytes(runner.model)
    graphs = runner.cuda_graphs
    results: dict[str, Any] = {
        "device": where,
        "torch": torch.__version__,
        "shape": args.shape,
        "dtype": llm.llm_engine.get_model_config().dtype,
        "copy_gbps": copy_gbps,
        "weight_bytes_per_token": weight_bytes,
        "start_s": start_s,
        "first_token_s": first_s,
        "cuda_graph_sizes": graphs.captured_sizes if graphs is not None else [],
    }
    print(
        f"{args.shape} ({results['dtype']}, {weight_bytes / 1e9:.2f} GB of decode weights): "
        f"ready in {start_s:.1f} s, first token {first_s * 1e3:.0f} ms after; CUDA graphs "
        f"for {len(results['cuda_graph_sizes'])} batch sizes",
        flush=True,
    )
    if args.part in ("decode", "all"):
        results["decode"] = part_decode(llm, args, copy_gbps, weight_bytes)
    if args.part in ("throughput", "all"):
        results["throughput"] = part_throughput(llm, args, device)
    if device.type == "cuda":
        results["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        print(f"peak GPU memory allocated: {results['peak_gpu_gib']:.1f} GiB")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
