"""The cost of batch-invariant inference on a GPU (EngineArgs `batch_invariant`,
docs/determinism.md): Llama-3.1-8B's shape (random weights) decode step at batch 1 and 200,
the mode off (cuBLAS, autotuned attention, split-KV) and on (kernels/batch_invariant_*.py).

    python benchmarks/gpu/batch_invariant_decode.py                 # the 8B shape, bf16
    python benchmarks/gpu/batch_invariant_decode.py --shape tiny --device cpu   # smoke

A decode step's ms is (time of 1 + N new tokens - time of 1) / N over `batch` prompts
(benchmarks/gpu/fp8_decode.py's `decode_step_ms`). With the mode on it also checks the
point of the mode: the first prompt's greedy tokens alone equal its tokens among the batch
(printed as `alone == in batch`; the plain engine is printed too, where they may differ).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

from benchmarks.gpu.decode_timing import timed_generate
from benchmarks.gpu.fp8_decode import decode_step_ms
from benchmarks.gpu.llama8b import SHAPES, write_model_dir
from engine import LLM


def _alone_equals_batched(llm: LLM, batch: int, prompt_len: int, tokens: int) -> bool:
    vocab = llm.llm_engine.get_model_config().vocab_size
    prompts = [
        [100 + (i * 37 + j * 11) % (vocab - 100) for j in range(prompt_len + i % 7)]
        for i in range(batch)
    ]
    _, alone = timed_generate(llm, prompts[:1], tokens)
    _, batched = timed_generate(llm, prompts, tokens)
    return alone[0] == batched[0]


def measure(args: argparse.Namespace, model_dir: Path, invariant: bool) -> dict[str, Any]:
    llm = LLM(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
        device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=max(args.batches), batch_invariant=invariant,
        attention_backend=args.attention_backend,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30) or None,
    )  # fmt: skip
    steps = {}
    for batch in args.batches:
        steps[str(batch)] = decode_step_ms(llm, batch, args.prompt_len, args.decode_tokens)
        print(
            f"batch_invariant={invariant}: decode step at batch {batch}: "
            f"{steps[str(batch)]:.2f} ms",
            flush=True,
        )
    same = _alone_equals_batched(llm, max(args.batches), args.prompt_len, args.decode_tokens)
    print(f"batch_invariant={invariant}: alone == in batch: {same}", flush=True)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"decode_step_ms": steps, "alone_equals_batched": same}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--attention-backend", default=None, help="default: the device's")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 200])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=float, default=0.0, help="0: what is left")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {"shape": args.shape, "device": args.device}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(args.shape, Path(tmp))
        results["off"] = measure(args, model_dir, invariant=False)
        results["on"] = measure(args, model_dir, invariant=True)
    for batch in args.batches:
        off, on = (
            results["off"]["decode_step_ms"][str(batch)],
            results["on"]["decode_step_ms"][str(batch)],
        )
        print(
            f"batch {batch}: mode on costs {on / off:.2f}x the plain step ({on:.2f} / {off:.2f} ms)"
        )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    # The mode's promise, checked where it runs: the probe alone equals the probe in a batch.
    return 0 if results["on"]["alone_equals_batched"] else 1


if __name__ == "__main__":
    sys.exit(main())
