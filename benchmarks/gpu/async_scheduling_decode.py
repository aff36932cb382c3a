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
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])


from benchmarks.gpu.decode_timing import timed_generate
from benchmarks.gpu.fp8_decode import decode_step_ms
from benchmarks.gpu.llama8b import write_model_dir
from benchmarks.gpu.mode_comparison import add_arguments, free_device_memory, start_engine


def measure(args: argparse.Namespace, model_dir: Path, on: bool) -> dict[str, Any]:
    llm = start_engine(args, model_dir, async_scheduling=on)
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
    free_device_memory()
    return {"decode_step_ms": steps, "tokens": tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3)
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
