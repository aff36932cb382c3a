"""The tokenizer process's start-up and memory with the light tokenizer (tokenizers + jinja2)
against transformers' (`PAGEDSERVE_TOKENIZER_BACKEND=transformers`), in the same run.

    python benchmarks/serving/tokenizer_start.py [--model DIR_OR_GGUF] [--repeats 3]

Starts one engine service (the default model unless --model), then `--repeats` times a fresh
`pagedserve tokenizer` process of each kind, alternating, in front of it, and prints per
process what benchmarks/serving/tokenizer_tier.py measures (`listening_s`, `ready_s` until
standard health says SERVING, `peak_rss_mib` after serving Generate, Tokenize and Encode),
then per kind the median and spread, and light/transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[2])

KINDS = {"transformers": "transformers", "light": ""}  # PAGEDSERVE_TOKENIZER_BACKEND


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model directory or .gguf file")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from benchmarks.serving.proc_cpu import free_port
    from benchmarks.serving.tokenizer_tier import _env, one_run
    from services.cli.supervisor import wait_until_serving
    from services.tokenizer_service.model_files import BACKEND_ENV

    model = ["--model", args.model] if args.model else []
    engine_address = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "services", "engine", *model, "--engine-addr", engine_address]
    engine = subprocess.Popen(
        [*argv, "--log-level", "WARNING"], env=_env(), cwd=Path(__file__).resolve().parents[2]
    )
    runs: dict[str, list[dict[str, object]]] = {kind: [] for kind in KINDS}
    try:
        if not wait_until_serving(engine_address, [engine], 600):
            raise RuntimeError("the engine service did not come up")
        for _ in range(args.repeats):
            for kind, value in KINDS.items():
                os.environ[BACKEND_ENV] = value  # the child's environment is a copy of ours
                run = one_run(model, engine_address)
                runs[kind].append(run)
                print(json.dumps({"tokenizer": kind, **run}), flush=True)
    finally:
        engine.terminate()
        engine.wait(60)
    medians: dict[str, dict[str, float]] = {}
    for kind, kind_runs in runs.items():
        medians[kind] = {}
        for key in ("listening_s", "ready_s", "peak_rss_mib"):
            values = [float(r[key]) for r in kind_runs]  # type: ignore[arg-type]
            medians[kind][key] = statistics.median(values)
            print(
                f"{kind:12s} {key}: median {statistics.median(values):.2f}, "
                f"spread {max(values) - min(values):.2f}, runs {values}"
            )
    for key in ("listening_s", "ready_s", "peak_rss_mib"):
        ratio = medians["light"][key] / medians["transformers"][key]
        print(f"light/transformers {key}: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
