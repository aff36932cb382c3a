"""GPT-OSS-shaped mixture-of-experts decode on the CPU (random weights), in the style of
benchmarks/moe.py: a reduced GPT-OSS (hidden 720 = 2880 / 4, 32 experts of 720, top-4 as
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

    .venv/bin/python benchmarks/gpt_oss_moe.py [--batch 64] [--max-tokens 32] [--repeats 3]
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.throughput import cpu_model, make_prompts
from engine.api.sampling_params import SamplingParams
from engine.layers.gpt_oss_moe import GptOssMoE, select_experts_topk_softmax
from engine.llm import LLM

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


def make_model(path: Path) -> Path:
    from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**SHAPE, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.02) if not name.endswith("norm.weight") else param.fill_(1.0)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    model.save_pretrained(path)
    return path


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


def engine_tok_s(path: Path, prompts, max_tokens: int, per_expert: bool) -> float:
    llm = LLM(model=str(path), max_model_len=512, enable_prefix_caching=False)
    if per_expert:
        for module in llm.llm_engine.runner.model.modules():
            if isinstance(module, GptOssMoE):
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


def layer_ms(path: Path, batch: int, repeats: int = 30) -> tuple[float, float]:
    llm = LLM(model=str(path), max_model_len=512)
    moe = next(m for m in llm.llm_engine.runner.model.modules() if isinstance(m, GptOssMoE))
    x = torch.randn(batch, SHAPE["hidden_size"])
    times = []
    for fn in (moe.forward, types.MethodType(_per_expert_forward, moe)):
        with torch.inference_mode():
            torch.testing.assert_close(fn(x), moe.forward(x), atol=1e-4, rtol=1e-4)
            for _ in range(3):
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
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(
        f"model: {SHAPE['num_hidden_layers']} layers, hidden {SHAPE['hidden_size']}, "
        f"{SHAPE['num_local_experts']} experts of {SHAPE['intermediate_size']}, "
        f"top-{SHAPE['num_experts_per_tok']}, vocab {SHAPE['vocab_size']}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "gpt-oss-tiny")
        prompts = make_prompts(args.batch, args.prompt_len, SHAPE["vocab_size"], seed=0)
        for batch in (1, args.batch):
            grouped_ms, loop_ms = layer_ms(path, batch)
            print(
                f"MoE layer at batch {batch}: grouped {grouped_ms:.2f} ms, per-expert loop "
                f"{loop_ms:.2f} ms ({loop_ms / grouped_ms:.2f}x)"
            )
        runs: dict[str, list[float]] = {"grouped": [], "per-expert loop": []}
        if not args.skip_transformers:
            runs["transformers"] = []
        for _ in range(args.repeats):
            runs["grouped"].append(engine_tok_s(path, prompts, args.max_tokens, False))
            runs["per-expert loop"].append(engine_tok_s(path, prompts, args.max_tokens, True))
            if "transformers" in runs:
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
