"""How long one engine step takes under a burst: the longest step decides how long every
stream in the batch waits, and (before issue 45) whether the watchdog took the engine for
a hung one.

    python benchmarks/offline/step_times.py                    # the default budget vs 2048
    python benchmarks/offline/step_times.py --budgets default 512 2048 --repeats 3

`--num-prompts` requests (256) of `--input-len` random token ids (32), `--output-len` tokens
each (16, `ignore_eos`), all added at once to an `LLMEngine` on the default model, as the
README's `bench serve --max-concurrency 256` sends them; then `step()` until done. Per step:
wall seconds and the process's CPU seconds (all threads; on a loaded machine the CPU
seconds are what the step costs, the wall seconds what it took). For each budget
(`max_num_batched_tokens`; `default` = the engine's own) the longest step's wall and CPU
seconds, the median step, and the whole burst's wall and CPU time: median and range over
`--repeats` runs, budgets alternating run by run.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from engine import EngineArgs, LLMEngine, SamplingParams


def _burst(engine: LLMEngine, ns: argparse.Namespace, run: int) -> dict[str, float]:
    rng = random.Random(run)
    params = SamplingParams(max_tokens=ns.output_len, ignore_eos=True, temperature=0.0)
    for i in range(ns.num_prompts):
        ids = [rng.randrange(100, 40_000) for _ in range(ns.input_len)]
        engine.add_request(f"r{run}-{i}", {"prompt_token_ids": ids}, params)
    walls: list[float] = []
    cpus: list[float] = []
    start, start_cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        wall, cpu = time.perf_counter(), time.process_time()
        engine.step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {
        "total_s": time.perf_counter() - start,
        "total_cpu_s": time.process_time() - start_cpu,
        "max_wall_s": max(walls),
        "max_cpu_s": max(cpus),
        "median_wall_s": statistics.median(walls),
        "steps": len(walls),
    }


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", nargs="+", default=["default", "2048"])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    ns = parser.parse_args()
    engines = {}
    for budget in ns.budgets:
        tokens = None if budget == "default" else int(budget)
        engine = LLMEngine.from_engine_args(EngineArgs(max_num_batched_tokens=tokens))
        engine.reset_prefix_cache()
        _burst(engine, argparse.Namespace(**{**vars(ns), "num_prompts": 8}), run=-1)  # warm
        engines[budget] = engine
    results: dict[str, list[dict[str, float]]] = {b: [] for b in ns.budgets}
    for run in range(ns.repeats):
        for budget, engine in engines.items():
            engine.reset_prefix_cache()
            results[budget].append(_burst(engine, ns, run))
    print(f"cpu: {os.cpu_count()} cores; load average before the end: {os.getloadavg()}")
    print(
        "budget    tokens/step  steps  longest step wall s  its CPU s  median step s  "
        "burst s  burst CPU s"
    )
    for budget, runs in results.items():
        sched = engines[budget].get_scheduler_config()
        print(
            f"{budget:<9} {sched.max_num_batched_tokens:>11}  {runs[0]['steps']:>5}  "
            f"{_spread([r['max_wall_s'] for r in runs]):>19}  "
            f"{_spread([r['max_cpu_s'] for r in runs]):>9}  "
            f"{_spread([r['median_wall_s'] for r in runs]):>13}  "
            f"{_spread([r['total_s'] for r in runs])}  "
            f"{_spread([r['total_cpu_s'] for r in runs])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
