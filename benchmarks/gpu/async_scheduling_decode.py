"""What async scheduling buys on a GPU (EngineArgs `async_scheduling`, docs/engine.md):
Llama-3.1-8B's shape (random weights) at batch 1 (ms/token) and batch 200 (ms per decode
step), the host scheduling step N+1 after step N (off) and while step N runs (on), and the
same greedy tokens both ways.

    python benchmarks/gpu/async_scheduling_decode.py                       # the 8B shape
    python benchmarks/gpu/async_scheduling_decode.py --shape tiny --device cpu   # smoke

A decode step's ms is (time of 1 + N new tokens - time of 1) / N over `batch` prompts
(benchmarks/gpu/fp8_decode.py's `decode_step_ms`); the median of `--repeats` runs. Exits 1
when the tokens differ.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
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


def measure(args: argparse.Namespace, model_dir: Path, on: bool) -> dict[str, Any]:
    llm = LLM(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
        device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=max(args.batches), async_scheduling=on,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30) or None,
    )  # fmt: skip
    steps: dict[str, Any] = {}
    for batch in args.batches:
        samples = [
            decode_step_ms(llm, batch, args.prompt_len, args.decode_tokens)
            for _ in range(args.repeats)
        ]
        steps[str(batch)] = {"ms": statistics.median(samples), "samples": samples}
        print(
            f"async_scheduling={on}: decode step at batch {batch}: "
            f"{steps[str(batch)]['ms']:.3f} ms (runs: {', '.join(f'{s:.3f}' for s in samples)})",
            flush=True,
        )
    vocab = llm.llm_engine.get_model_config().vocab_size
    prompts = [
        [100 + (i * 37 + j * 11) % (vocab - 100) for j in range(args.prompt_len + i % 5)]
        for i in range(min(8, max(args.batches)))
    ]
    _, tokens = timed_generate(llm, prompts, args.decode_tokens)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"decode_step_ms": steps, "tokens": tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 200])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=float, default=0.0, help="0: what is left")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {"shape": args.shape, "device": args.device}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(args.shape, Path(tmp))
        results["off"] = measure(args, model_dir, on=False)
        results["on"] = measure(args, model_dir, on=True)
    for batch in args.batches:
        off = results["off"]["decode_step_ms"][str(batch)]["ms"]
        on = results["on"]["decode_step_ms"][str(batch)]["ms"]
        print(f"batch {batch}: async scheduling {off / on:.2f}x ({off:.3f} -> {on:.3f} ms/step)")
    same = results["off"]["tokens"] == results["on"]["tokens"]
    results["same_tokens"] = same
    print(f"greedy tokens off == on: {same}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
