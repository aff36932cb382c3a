"""Quality of the CPU fast paths on the default model: KV cache dtype and the int8 route.

    python benchmarks/cpu_paths/cpu_paths_quality.py                    # all configurations
    python benchmarks/cpu_paths/cpu_paths_quality.py --configs ref q4-fp16kv --num-prompts 8

The fast paths change numbers, not only speed: a 16-bit KV cache rounds every K/V row, and
the int8 route ($PAGEDSERVE_QUANT_ROUTE=int8, engine/layers/quant_select.py) rounds the
activations of quantized layers on batched steps. Each configuration is an engine of its own,
one after another in this process, measured by:
1. perplexity of a fixed English text: the CPython LICENSE.txt of the running interpreter
   (the history of Python and its licenses, ~3k tokens, shipped with every CPython; its
   sha256 is printed), split into consecutive `--window`-token windows, each a prompt with
   `prompt_logprobs=0` (vLLM's semantics: the logprob of every prompt token after the
   first); transformers in fp32 on the engine's converted directory is the outside
   reference;
2. greedy agreement with the fp32 reference engine: `--num-prompts` chat prompts
   (benchmarks/offline/chat_prompts.py) x `--output-len` greedy tokens (`ignore_eos`), all in one
   batch (so the int8 route applies): the fraction of prompts whose tokens are identical,
   and the mean position of the first differing token (`--output-len` where none differs).
The reference (`ref`) is the GGUF file's blocks dequantized to fp32 (`quantization=None`), and
transformers reads the same converted weights: the Q4_1 blocks kept quantized compute the same
products (only the summation order differs), so this measures the fast paths against fp32
arithmetic on the same weights, not Q4_1 against the original bf16 checkpoint (not shipped).
No sampling and no timing enter the figures: they are reproducible for a CPU and thread count.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

from engine import LLM, SamplingParams

ROUTE_ENV = "PAGEDSERVE_QUANT_ROUTE"
# name -> (description, LLM kwargs, $PAGEDSERVE_QUANT_ROUTE)
CONFIGS = {
    "ref": (
        "fp32 weights, fp32 KV (reference)",
        dict(quantization=None, dtype="float32", kv_cache_dtype="float32"),
        "fp32",
    ),
    "q4-fp32kv": ("Q4_1 kept, fp32 KV, fp32 route", dict(kv_cache_dtype="float32"), "fp32"),
    "q4-fp16kv": ("Q4_1 kept, fp16 KV (auto), fp32 route", dict(kv_cache_dtype="auto"), "fp32"),
    "q4-fp16kv-int8": ("Q4_1 kept, fp16 KV, int8 route", dict(kv_cache_dtype="auto"), "int8"),
    "q4-bf16kv": ("Q4_1 kept, bf16 KV, fp32 route", dict(kv_cache_dtype="bfloat16"), "fp32"),
}


def corpus() -> tuple[str, str]:
    """The text and its description (path, size, sha256)."""
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()[:16]
    return (
        data.decode(),
        f"CPython {sys.version.split()[0]} LICENSE.txt ({len(data)} B, sha256 {digest}...)",
    )


def windows(tokenizer, text: str, size: int) -> list[list[int]]:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return [ids[i : i + size] for i in range(0, len(ids) - size + 1, size)]


def engine_logprobs(llm: LLM, prompts: list[list[int]]) -> list[float]:
    """The logprob of every prompt token after each window's first, windows in order."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for prompt, output in zip(prompts, outputs):
        for token, entry in zip(prompt[1:], output.prompt_logprobs[1:]):
            result.append(entry[token].logprob)
    return result


def hf_logprobs(model_dir: Path, prompts: list[list[int]]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    result = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            result += logprobs.gather(1, ids[0, 1:, None])[:, 0].tolist()
    del model
    return result


def greedy(llm: LLM, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def int8_parts(llm: LLM) -> int:
    from engine.layers.quantization import CPUQuantizedLinearMethod

    methods = [
        m.quant_method
        for m in llm.llm_engine.runner.model.modules()
        if isinstance(getattr(m, "quant_method", None), CPUQuantizedLinearMethod)
    ]
    return sum(r is not None for m in methods for r in getattr(m, "routes", None) or [])


def run_config(name: str, args, text: str) -> dict:
    description, kwargs, route = CONFIGS[name]
    previous = os.environ.get(ROUTE_ENV)
    os.environ[ROUTE_ENV] = route  # read by quant_select at load (model_loader)
    try:
        start = time.perf_counter()
        llm = LLM(seed=0, **kwargs)
    finally:
        os.environ.pop(ROUTE_ENV) if previous is None else os.environ.update({ROUTE_ENV: previous})
    config = llm.llm_engine.get_model_config()
    model_dir = config.model_dir
    from benchmarks.offline.chat_prompts import chat_prompts

    text_prompts = windows(llm.get_tokenizer(), text, args.window)
    print(
        f"{name}: quantization {config.quantization}, KV cache "
        f"{llm.llm_engine.get_cache_config().cache_dtype}, int8-route parts {int8_parts(llm)}",
        flush=True,
    )
    result = {
        "name": name,
        "description": description,
        "int8_parts": int8_parts(llm),
        "model_dir": model_dir,
        "windows": text_prompts,
        "logprobs": engine_logprobs(llm, text_prompts),
        "tokens": greedy(llm, chat_prompts(model_dir, args.num_prompts), args.output_len),
    }
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    result["seconds"] = time.perf_counter() - start
    return result


def ppl(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def compare(r: dict, base: dict, output_len: int) -> str:
    """Mean |logprob difference| per text token, prompts with identical greedy tokens, and the
    mean position of the first differing token (`output_len` where none differs)."""
    dlogp = sum(abs(a - b) for a, b in zip(r["logprobs"], base["logprobs"])) / len(r["logprobs"])
    same = div = "-"
    if r["tokens"] is not None:
        firsts = [first_divergence(a, b) for a, b in zip(r["tokens"], base["tokens"])]
        same = f"{sum(f == output_len for f in firsts)}/{len(firsts)}"
        div = f"{sum(firsts) / len(firsts):.1f}"
    return f"{dlogp:8.4f} {same:>5} {div:>5}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    args = parser.parse_args()
    if args.configs[0] != "ref":
        args.configs = ["ref", *[c for c in args.configs if c != "ref"]]
    from benchmarks.offline.host_machine import cpu_model

    text, source = corpus()
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    started = time.perf_counter()
    results = [run_config(name, args, text) for name in args.configs]
    ref = results[0]
    n_tokens = len(ref["logprobs"])
    windows_n = len(ref["windows"])
    print(f"text: {source}: {windows_n} windows x {args.window} tokens, {n_tokens} predicted")
    print(f"greedy: {args.num_prompts} chat prompts x {args.output_len} tokens each")
    rows = []
    if not args.no_hf:
        start = time.perf_counter()
        hf = {"logprobs": hf_logprobs(ref["model_dir"], ref["windows"]), "tokens": None}
        hf.update(description="transformers fp32 (outside reference)", int8_parts="-")
        rows.append({**hf, "seconds": time.perf_counter() - start})
    rows += results
    # The previous default (fp32 KV) as a second baseline: what the fp16 KV / int8 route change.
    base = next((r for r in results if r["name"] == "q4-fp32kv"), None)
    against = [("ref", ref)] + [("Q4_1 fp32 KV", base)] * (base is not None)
    print(" " * 60 + "".join(f"{'vs ' + name:>21}" for name, _ in against))
    head = f"{'configuration':39} {'int8':>4} {'ppl':>7} {'/ref':>7}"
    print(head + f" {'|dlogp|':>8} {'same':>5} {'1st':>5}" * len(against) + f" {'s':>5}")
    ref_ppl = ppl(ref["logprobs"])
    for r in rows:
        value = ppl(r["logprobs"])
        line = f"{r['description']:39} {r['int8_parts']:>4} {value:7.3f} {value / ref_ppl:7.4f}"
        line += "".join(" " + compare(r, other, args.output_len) for _, other in against)
        print(f"{line} {r['seconds']:5.0f}")
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
