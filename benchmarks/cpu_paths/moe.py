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

    .venv/bin/python benchmarks/cpu_paths/moe.py [--batch 64] [--max-tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from benchmarks.cpu_paths.moe_harness import MoEBench, add_arguments, run
from engine.layers.moe import FusedMoE, select_experts
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


def _per_expert_forward(self: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    weights, ids = select_experts(self.gate(x), self.moe.top_k, self.moe.renormalize)
    return ref_moe_experts(x, self.w13_weight, self.w2_weight, weights, ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--experts", type=int, default=SHAPE["num_local_experts"])
    parser.add_argument("--top-k", type=int, default=SHAPE["num_experts_per_tok"])
    parser.add_argument("--intermediate", type=int, default=SHAPE["intermediate_size"])
    args = parser.parse_args()
    SHAPE.update(
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        intermediate_size=args.intermediate,
    )
    bench = MoEBench(
        "mixtral-tiny", SHAPE, "MixtralConfig", "MixtralForCausalLM", FusedMoE, _per_expert_forward
    )
    run(bench, args, layer_batches=(args.batch,))


if __name__ == "__main__":
    main()
