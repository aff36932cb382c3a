"""Tensor / pipeline parallelism: the same offline workload on one process and on ranks.

    python benchmarks/offline/parallel.py                         # TP=1 vs TP=2 vs PP=2
    python benchmarks/offline/parallel.py --configs 1x1 2x1 4x1   # TPxPP, e.g. on a GPU machine

On CPU the comparison is the one that holds the machine fixed: TP=1 with every core as
intra-op threads against N ranks with cores / N threads each (the executor splits them);
on two cores expect a ratio near 1. On a machine with several GPUs each rank takes one GPU
and the ratio is the scaling from 1 to N.

The default model (SmolLM2-135M) has 9 attention heads, which do not split over 2 ranks;
without `--model` the benchmark builds (once, under the model cache) a random-weight Llama of
the same size with 8 heads of 72 (hidden 576, 2 KV heads, intermediate 1536, 30 layers,
vocabulary 49152). Per rank configuration it prints output tokens/s, the ratio to the first
configuration, and from the ranks themselves the time per step spent in all-reduces (TP)
and in stage-to-stage transfers (PP).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.offline.host_machine import cpu_model
from benchmarks.offline.throughput import make_prompts, run_engine
from engine import LLM


def default_like_model() -> Path:
    """A random Llama shaped like SmolLM2-135M but with 8 heads (splits over 2 or 4)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.api.model_files import cache_root

    path = cache_root() / "bench-smollm2-shaped-8-heads"
    if (path / "config.json").is_file():
        return path
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=72,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def collective_ms_per_step(llm: LLM) -> tuple[float, float]:
    """(all-reduce ms, stage-transfer ms) per step on the ranks, averaged over ranks."""
    executor = llm.llm_engine.executor
    if not hasattr(executor, "collective_stats"):
        return 0.0, 0.0
    stats = executor.collective_stats()
    per_rank = [
        (1e3 * s["all_reduce_s"] / s["num_steps"], 1e3 * s["stage_transfer_s"] / s["num_steps"])
        for s in stats
        if s["num_steps"]
    ]
    return (
        statistics.mean(a for a, _ in per_rank),
        statistics.mean(t for _, t in per_rank),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory (default: see above)")
    parser.add_argument("--configs", nargs="+", default=["1x1", "2x1", "1x2"], help="TPxPP")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    model = args.model or str(default_like_model())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU: {cpu_model()}")
    print(f"model {model}; {args.num_prompts} prompts x {args.input_len} -> {args.output_len}")
    results: list[tuple[str, float]] = []
    for spec in args.configs:
        tp, pp = (int(n) for n in spec.lower().split("x"))
        llm = LLM(
            model=model,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            skip_tokenizer_init=True,
            kv_cache_memory_bytes=1 << 30,
        )
        prompts = make_prompts(args.num_prompts, args.input_len, 49152, 0)
        run_engine(llm, make_prompts(2, args.input_len, 49152, 1), 4)  # warm-up
        elapsed = statistics.median(
            run_engine(llm, prompts, args.output_len) for _ in range(args.repeats)
        )
        tok_s = args.num_prompts * args.output_len / elapsed
        all_reduce_ms, transfer_ms = collective_ms_per_step(llm)
        llm.llm_engine.shutdown()
        results.append((spec, tok_s))
        print(
            f"TP={tp} PP={pp}: {tok_s:.1f} output tok/s ({elapsed:.2f} s); per step on the "
            f"ranks: all-reduce {all_reduce_ms:.2f} ms, stage transfers {transfer_ms:.2f} ms"
        )
    base_name, base = results[0]
    for name, tok_s in results[1:]:
        print(f"{name} vs {base_name}: {tok_s / base:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
