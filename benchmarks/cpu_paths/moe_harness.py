"""The timing harness the two MoE benchmarks share (cpu_paths/moe.py: Mixtral-shaped,
cpu_paths/gpt_oss_moe.py: GPT-OSS-shaped): one random-weight model, the MoE layer alone, and
whole decode runs of the engine (grouped GEMMs), of the engine with transformers' per-expert
loop patched into every MoE layer, and of transformers' `generate`.

A benchmark hands over an `MoEBench`: the config's shape, the transformers classes, the
engine's MoE layer type and the per-expert forward to patch in; `run` does the rest.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.offline.host_machine import cpu_model
from benchmarks.offline.throughput import make_prompts
from engine.api.sampling_params import SamplingParams
from engine.llm import LLM


@dataclass
class MoEBench:
    name: str  # the model directory's name
    shape: dict[str, Any]  # the transformers config's keyword arguments
    config_class: str  # transformers class names, e.g. "MixtralConfig"
    model_class: str
    layer_type: type[torch.nn.Module]  # the engine's MoE layer
    per_expert_forward: Callable[[Any, torch.Tensor], torch.Tensor]  # forward(layer, x)


def make_model(bench: MoEBench, path: Path) -> Path:
    import transformers

    config_class = getattr(transformers, bench.config_class)
    model_class = getattr(transformers, bench.model_class)
    torch.manual_seed(0)
    model = model_class(config_class(**bench.shape, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.02) if not name.endswith("norm.weight") else param.fill_(1.0)
    model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2)
    model.save_pretrained(path)
    return path


def engine_tok_s(bench: MoEBench, path: Path, prompts, max_tokens: int, per_expert: bool) -> float:
    """Output tok/s of one batch, after a warm-up on its first 4 prompts."""
    llm = LLM(model=str(path), max_model_len=512, enable_prefix_caching=False)
    if per_expert:
        for module in llm.llm_engine.runner.model.modules():
            if isinstance(module, bench.layer_type):
                module.forward = types.MethodType(bench.per_expert_forward, module)
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


def layer_ms(bench: MoEBench, path: Path, batch: int, repeats: int) -> tuple[float, float]:
    """Milliseconds per call of the first MoE layer: (grouped, per-expert loop); the loop's
    output is checked against the grouped one first."""
    llm = LLM(model=str(path), max_model_len=512)
    moe = next(m for m in llm.llm_engine.runner.model.modules() if isinstance(m, bench.layer_type))
    x = torch.randn(batch, bench.shape["hidden_size"])
    times = []
    for fn in (moe.forward, types.MethodType(bench.per_expert_forward, moe)):
        with torch.inference_mode():
            torch.testing.assert_close(fn(x), moe.forward(x), atol=1e-4, rtol=1e-4)
            for _ in range(3):
                fn(x)
            start = time.perf_counter()
            for _ in range(repeats):
                fn(x)
        times.append((time.perf_counter() - start) / repeats * 1e3)
    return times[0], times[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layer-repeats", type=int, default=30, help="calls per layer timing")
    parser.add_argument("--skip-transformers", action="store_true")


def run(bench: MoEBench, args: argparse.Namespace, layer_batches: tuple[int, ...]) -> None:
    """Prints the layer timings at `layer_batches`, then the three decode figures (medians
    of `--repeats` runs, each run's figure beside them)."""
    shape = bench.shape
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(
        f"model: {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
        f"{shape['num_local_experts']} experts of {shape['intermediate_size']}, "
        f"top-{shape['num_experts_per_tok']}, vocab {shape['vocab_size']}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(bench, Path(tmp) / bench.name)
        prompts = make_prompts(args.batch, args.prompt_len, shape["vocab_size"], seed=0)
        for batch in layer_batches:
            grouped_ms, loop_ms = layer_ms(bench, path, batch, args.layer_repeats)
            print(
                f"MoE layer at batch {batch}: grouped {grouped_ms:.2f} ms, per-expert loop "
                f"{loop_ms:.2f} ms ({loop_ms / grouped_ms:.2f}x)"
            )
        runs: dict[str, list[float]] = {"grouped": [], "per-expert loop": []}
        if not args.skip_transformers:
            runs["transformers"] = []
        for _ in range(args.repeats):
            runs["grouped"].append(engine_tok_s(bench, path, prompts, args.max_tokens, False))
            runs["per-expert loop"].append(
                engine_tok_s(bench, path, prompts, args.max_tokens, True)
            )
            if "transformers" in runs:
                runs["transformers"].append(transformers_tok_s(path, prompts, args.max_tokens))
        medians = {name: statistics.median(v) for name, v in runs.items()}
        for name, value in medians.items():
            runs_text = ", ".join(f"{v:.1f}" for v in runs[name])
            print(
                f"{name:>16}: {value:8.1f} output tok/s  (grouped / this: "
                f"{medians['grouped'] / value:.2f}x; runs {runs_text})"
            )
