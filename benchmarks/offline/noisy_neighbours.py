"""Offline throughput with busy neighbours on the same cores: the engine's OpenMP settings.

    python benchmarks/offline/noisy_neighbours.py --hogs 2 --repeats 3
    python benchmarks/offline/noisy_neighbours.py --settings GOMP_SPINCOUNT=10000 \
        GOMP_SPINCOUNT=300000

A served engine rarely has its cores to itself (other replicas, the tokenizer tier, a noisy
VM neighbour). `--hogs N` starts N processes that spin in pure Python for the whole run; each
`--settings` entry (environment assignments, `-` for none) runs the default model's offline
workload (chat prompts x `--output-len` greedy tokens, `ignore_eos`) in a fresh interpreter,
since libgomp reads its settings once when torch loads it. The settings alternate run by run;
medians and every run are printed. `--hogs 0` measures the quiet cost of the same settings.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

WORKLOAD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from engine import LLM, SamplingParams
from chat_prompts import chat_prompts
llm = LLM()
prompts = chat_prompts(llm.llm_engine.get_model_config().model_dir, int(sys.argv[2]))
params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True)
llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
llm.llm_engine.reset_prefix_cache()
start = time.perf_counter()
llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
print(json.dumps({"elapsed_s": time.perf_counter() - start}))
"""


def _spin() -> None:
    while True:
        pass


def _run(setting: str, num_prompts: int, output_len: int) -> float:
    env = dict(os.environ)
    if setting != "-":
        env.update(item.split("=", 1) for item in setting.split(","))
    here = str(Path(__file__).resolve().parent)
    done = subprocess.run(
        [sys.executable, "-c", WORKLOAD, here, str(num_prompts), str(output_len)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])["elapsed_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hogs", type=int, default=2, help="busy processes beside the engine")
    parser.add_argument("--settings", nargs="+", default=["-", "GOMP_SPINCOUNT=300000"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from benchmarks.offline.host_machine import cpu_model

    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs, {args.hogs} busy neighbours")
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    time.sleep(1.0)
    runs: dict[str, list[float]] = {setting: [] for setting in args.settings}
    try:
        for _ in range(args.repeats):
            for setting in args.settings:
                runs[setting].append(_run(setting, args.num_prompts, args.output_len))
                print(f"{setting:>28}: {runs[setting][-1]:.2f} s", flush=True)
    finally:
        for hog in hogs:
            hog.terminate()
    tokens = args.num_prompts * args.output_len
    for setting, times in runs.items():
        median = statistics.median(times)
        print(
            f"{setting:>28}: median {median:.2f} s ({tokens / median:.1f} output tok/s), "
            f"runs {', '.join(f'{t:.2f}' for t in times)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
