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
import json
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
    llm = start_engine(
        args, model_dir, batch_invariant=invariant, attention_backend=args.attention_backend
    )
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
    free_device_memory()
    return {"decode_step_ms": steps, "alone_equals_batched": same}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--attention-backend", default=None, help="default: the device's")
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
