"""GPT-OSS-shaped mixture-of-experts decode on the CPU (random weights), in the style of
benchmarks/cpu_paths/moe.py: a reduced GPT-OSS (hidden 720 = 2880 / 4, 32 experts of 720, top-4 as
gpt-oss-20b, 16 query heads and 2 KV heads of 64 with sinks, alternating window-128 and full
layers, vocab 32000; 2 layers) at batch `--batch`, greedy, `--max-tokens` tokens each.

Three figures in one run, output tokens per second of the decode:

- `grouped`: the engine as it runs (rows sorted by expert, one grouped GEMM per projection,
  the experts' biases added per row, the clamped SwiGLU; the native C GEMM where it builds);
- `per-expert loop`: the same engine with each MoE layer computing its experts as
  transformers' GptOssExperts does (a Python loop over the experts hit, gather, two matmuls
  with biases and an index_add each);
- `transformers`: `generate` on the same prompts in one batch.

Also the MoE layer alone at batch 1 and at `--batch` (one decode step's tokens): milliseconds
per call of the grouped path and of the per-expert loop.

    python benchmarks/cpu_paths/gpt_oss_moe.py [--batch 64] [--max-tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from benchmarks.cpu_paths.moe_harness import MoEBench, add_arguments, run
from engine.layers.gpt_oss_moe import GptOssMoE, select_experts_topk_softmax

SHAPE = dict(
    vocab_size=32000,
    hidden_size=720,
    intermediate_size=720,
    num_hidden_layers=2,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,
    max_position_embeddings=1024,
    # GPT-OSS's YaRN (factor 32), over a trained length that fits max_position_embeddings.
    rope_parameters={
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 32,
        "rope_theta": 150000.0,
    },
)


def _per_expert_forward(self: GptOssMoE, x: torch.Tensor) -> torch.Tensor:
    """transformers' GptOssExperts loop over our stacked (gate | up) weights."""
    weights, ids = select_experts_topk_softmax(self.router(x), self.moe.top_k)
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=self.w13_weight.shape[0]).permute(2, 1, 0)  # [E, k, T]
    for expert in torch.nonzero(mask.sum(dim=(1, 2))).flatten().tolist():
        pos, token = torch.where(mask[expert])
        h = F.linear(x[token], self.w13_weight[expert], self.w13_bias[expert])
        y = F.linear(self.act_fn(h), self.w2_weight[expert], self.w2_bias[expert])
        out.index_add_(0, token, y * weights[token, pos, None])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args()
    bench = MoEBench(
        "gpt-oss-tiny", SHAPE, "GptOssConfig", "GptOssForCausalLM", GptOssMoE, _per_expert_forward
    )
    run(bench, args, layer_batches=(1, args.batch))


if __name__ == "__main__":
    main()
