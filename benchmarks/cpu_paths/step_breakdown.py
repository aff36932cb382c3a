"""Where a batched decode step's time goes, on the default model (offline workload).

    python benchmarks/cpu_paths/step_breakdown.py                          # fp32 and GGUF blocks
    python benchmarks/cpu_paths/step_breakdown.py --quantization auto --kv-cache-dtype bfloat16

Submits `--num-prompts` random prompts of `--input-len` tokens (`--output-len` tokens each,
greedy, `ignore_eos`) to one engine, steps it to the end, and reports the mean time of the
pure decode steps (after the prefill steps) split by module: the projections
(`Linear.forward`), attention (the backend's KV write + attention), the LM head
(`compute_logits`), the norms, SiLU-and-mul, and the rest (rotary, sampling, the
scheduler, Python; and the whole layer stack where a step of 1..8 rows takes the native
whole-step path). The LM head counts `compute_logits` and, for the greedy rows that take
the greedy screen instead, `greedy_argmax`. `--emulate-isa avx2` runs it as an AVX2-only
CPU (throughput.py's cap). Each module's method is wrapped by a timer for the run, which adds a
few microseconds per call. Prints the CPU model.
"""

from __future__ import annotations

import argparse
import collections
import functools
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

from benchmarks.offline.host_machine import add_emulate_isa_argument, cpu_model, reexec_with_isa
from engine import LLM, SamplingParams
from engine.attention.backend import SplitAttentionBackend
from engine.layers.linear import Linear
from engine.layers.ops import RMSNorm, SiluAndMul
from engine.models.decoder import DecoderForCausalLM

_PARTS = (
    (Linear, "forward", "projections"),
    (SplitAttentionBackend, "forward", "attention"),
    (DecoderForCausalLM, "compute_logits", "LM head"),
    (DecoderForCausalLM, "greedy_argmax", "LM head"),
    (RMSNorm, "forward", "norms"),
    (SiluAndMul, "forward", "SiLU"),
)


def timed(spent: collections.Counter, key: str, method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start

    return wrapper


def breakdown(args: argparse.Namespace, quantization: str, kv_cache_dtype: str) -> None:
    llm = LLM(
        None,
        quantization=None if quantization == "none" else quantization,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = llm.llm_engine
    rng = random.Random(args.seed)
    vocab = engine.get_model_config().vocab_size
    prompts = [
        [rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], warm, use_tqdm=False)
    engine.reset_prefix_cache()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    spent: collections.Counter = collections.Counter()
    originals = [(cls, name, getattr(cls, name)) for cls, name, _ in _PARTS]
    for (cls, name, key), (_, _, method) in zip(_PARTS, originals, strict=True):
        setattr(cls, name, timed(spent, key, method))
    started: set[str] = set()  # requests past their prefill
    total, decode_steps = 0.0, 0
    try:
        while engine.has_unfinished_requests():
            all_decode = len(started) == len(prompts)
            start = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - start
            if all_decode:
                total += elapsed
                decode_steps += 1
            else:
                spent.clear()  # pure decode steps only
            started.update(o.request_id for o in outputs if o.outputs[0].token_ids)
    finally:
        for cls, name, method in originals:
            setattr(cls, name, method)
    resolved = engine.get_model_config().quantization or "fp32"
    cache = engine.get_cache_config().cache_dtype
    spent["rest"] = total - sum(spent.values())
    parts = ", ".join(f"{k} {v / decode_steps * 1e3:.1f}" for k, v in spent.items())
    print(
        f"{resolved}, KV cache {cache}: {decode_steps} decode steps of {args.num_prompts} rows, "
        f"{total / decode_steps * 1e3:.1f} ms per step: {parts}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", nargs="+", default=["none", "auto"])
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    add_emulate_isa_argument(parser)
    args = parser.parse_args()
    if args.emulate_isa:
        reexec_with_isa(args.emulate_isa)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU: {cpu_model()}")
    for quantization in args.quantization:
        for kv_cache_dtype in args.kv_cache_dtype:
            breakdown(args, quantization, kv_cache_dtype)


if __name__ == "__main__":
    main()
