"""Mixture-of-experts decode on the CPU: a tiny Mixtral-shaped model (random weights) at
batch 64, greedy, every request decoding `--max-tokens` tokens.

Three figures in one run, output tokens per second of the decode:

- `grouped`: the engine as it runs (rows sorted by expert, one grouped GEMM per projection:
  the native C kernel on a CPU where it builds);
- `per-expert loop`: the same engine with each MoE layer computing its experts as
  transformers does (a Python loop over the experts hit, gather, two matmuls and an
  index_add each) — what the grouped path replaces;
- `transformers`: `generate` on the same prompts in one batch of 64.

Also the MoE layer alone at batch 64 (one decode step's tokens): milliseconds per call of the
grouped path and of the per-expert loop.

    .venv/bin/python benchmarks/moe.py [--batch 64] [--max-tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.throughput import cpu_model, make_prompts
from engine.api.sampling_params import SamplingParams
from engine.layers.moe import FusedMoE, select_experts
from engine.llm import LLM
from kernels.reference import ref_moe_experts

# Mixtral's proportions scaled down: 8 experts, top-2, intermediate = 3.5 x hidden.
# `--experts 64 --top-k 8 --intermediate 128` gives Qwen3-MoE's many small experts instead.
SHAPE = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1792,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=1024,
)


def make_model(path: Path) -> Path:
    from transformers import GenerationConfig, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**SHAPE, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.02) if not name.endswith("norm.weight") else param.fill_(1.0)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    model.save_pretrained(path)
    return path


def _per_expert_forward(self: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    weights, ids = select_experts(self.gate(x), self.moe.top_k, self.moe.renormalize)
    return ref_moe_experts(x, self.w13_weight, self.w2_weight, weights, ids)


def engine_tok_s(path: Path, prompts, max_tokens: int, per_expert: bool) -> float:
    llm = LLM(model=str(path), max_model_len=512, enable_prefix_caching=False)
    if per_expert:
        for module in llm.llm_engine.runner.model.modules():
            if isinstance(module, FusedMoE):
                module.forward = types.MethodType(_per_expert_forward, module)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def transformers_tok_s(path: Path, prompts, max_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)  # same length: no padding needed
    with torch.inference_mode():
        model.generate(ids[:4], max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        out = model.generate(
            ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
        )
        elapsed = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / elapsed


def layer_ms(path: Path, batch: int, repeats: int = 50) -> tuple[float, float]:
    llm = LLM(model=str(path), max_model_len=512)
    moe = next(m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedMoE))
    x = torch.randn(batch, SHAPE["hidden_size"])
    times = []
    for fn in (moe.forward, types.MethodType(_per_expert_forward, moe)):
        with torch.inference_mode():
            for _ in range(5):
                fn(x)
            start = time.perf_counter()
            for _ in range(repeats):
                fn(x)
        times.append((time.perf_counter() - start) / repeats * 1e3)
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--experts", type=int, default=SHAPE["num_local_experts"])
    parser.add_argument("--top-k", type=int, default=SHAPE["num_experts_per_tok"])
    parser.add_argument("--intermediate", type=int, default=SHAPE["intermediate_size"])
    args = parser.parse_args()
    SHAPE.update(
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        intermediate_size=args.intermediate,
    )
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(
        f"model: {SHAPE['num_hidden_layers']} layers, hidden {SHAPE['hidden_size']}, "
        f"{args.experts} experts of {args.intermediate}, top-{args.top_k}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "mixtral-tiny")
        prompts = make_prompts(args.batch, args.prompt_len, SHAPE["vocab_size"], seed=0)
        grouped_ms, loop_ms = layer_ms(path, args.batch)
        print(
            f"MoE layer at batch {args.batch}: grouped {grouped_ms:.2f} ms, per-expert loop "
            f"{loop_ms:.2f} ms ({loop_ms / grouped_ms:.2f}x)"
        )
        runs: dict[str, list[float]] = {"grouped": [], "per-expert loop": [], "transformers": []}
        for _ in range(args.repeats):
            runs["grouped"].append(engine_tok_s(path, prompts, args.max_tokens, False))
            runs["per-expert loop"].append(engine_tok_s(path, prompts, args.max_tokens, True))
            runs["transformers"].append(transformers_tok_s(path, prompts, args.max_tokens))
        medians = {name: statistics.median(v) for name, v in runs.items()}
        for name, value in medians.items():
            runs_text = ", ".join(f"{v:.1f}" for v in runs[name])
            print(
                f"{name:>16}: {value:8.1f} output tok/s  (grouped / this: "
                f"{medians['grouped'] / value:.2f}x; runs {runs_text})"
            )


if __name__ == "__main__":
    main()
