"""The cost of batch-invariant inference (EngineArgs `batch_invariant`) on the CPU.

    python benchmarks/offline/batch_invariant.py            # default model, 3 runs each

Two engines of the same model in one process, the mode off and on, measured in turns
(off, on, off, on, ...) so a shared machine's drift hits both: offline throughput
(`--num-prompts` chat prompts, `--output-len` tokens each with `ignore_eos`, all submitted
at once to `LLM.generate`) and single-stream decode (one request, `--stream-len` tokens).
Prints, per workload and mode, the median output tokens/s over `--repeats` runs with their
range, the process CPU seconds of the median run, and the on/off ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from engine import LLM, SamplingParams


def _timed(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, float, int]:
    """(wall s, process CPU s, output tokens) of one generate call."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.reset_prefix_cache()  # every run prefills its prompts
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, sum(len(o.outputs[0].token_ids) for o in outputs)


def _report(name: str, runs: dict[bool, list[tuple[float, float, int]]]) -> None:
    medians = {}
    for mode, results in runs.items():
        rates = sorted(tokens / wall for wall, _, tokens in results)
        median = statistics.median(rates)
        cpu = statistics.median(c for _, c, _ in results)
        medians[mode] = median
        label = "on " if mode else "off"
        print(
            f"{name:14s} batch_invariant {label}: {median:8.1f} tok/s "
            f"(runs {rates[0]:.1f}..{rates[-1]:.1f}), CPU {cpu:.2f} s per run"
        )
    print(f"{name:14s} on/off: {medians[True] / medians[False]:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--stream-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from benchmarks.offline.chat_prompts import chat_prompts

    engines = {mode: LLM(args.model, batch_invariant=mode) for mode in (False, True)}
    model_dir = engines[False].llm_engine.config.model_config.model_dir
    prompts = chat_prompts(Path(model_dir), args.num_prompts)
    for llm in engines.values():  # warm-up: first-call costs out of the figures
        _timed(llm, prompts[:4], 4)
    offline: dict[bool, list] = {False: [], True: []}
    stream: dict[bool, list] = {False: [], True: []}
    for _ in range(args.repeats):
        for mode, llm in engines.items():
            offline[mode].append(_timed(llm, prompts, args.output_len))
            stream[mode].append(_timed(llm, prompts[:1], args.stream_len))
    print(f"{args.num_prompts} prompts x {args.output_len} tokens; 1 stream x {args.stream_len}")
    _report("offline", offline)
    _report("single-stream", stream)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
