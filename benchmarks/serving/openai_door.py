"""The OpenAI door under a third-party load generator, next to the gRPC API under ours.

Starts `pagedserve serve --openai-port` (the default model unless --model), then, in each
run, the same load twice on the same server: `pagedserve bench serve` against the gRPC API,
and NVIDIA's AIPerf (pinned, PyPI `aiperf`) against the OpenAI API (`/v1/completions`,
streamed), with the same prompt count, prompt and output lengths (`ignore_eos`) and
concurrency. Prints TTFT, TPOT, ITL and throughputs side by side, and the door's figures as
ratios of the gRPC API's.

    python benchmarks/serving/openai_door.py --runs 3

AIPerf is installed on first use into its own virtual environment under the benchmark cache
(`--tools-dir`, default ~/.cache/pagedserve/bench-tools): it pulls pandas, dash and much else
(no torch), none of which the project needs. `--aiperf PATH` uses an installed one.

Names differ between the two tools: AIPerf's "inter_token_latency" is per request,
(latency - TTFT) / (output tokens - 1), which is what `bench serve` calls TPOT; AIPerf's
"inter_chunk_latency" is the gap between streamed chunks, `bench serve`'s ITL.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]  # runs from a checkout without installing

from benchmarks.serving.proc_cpu import free_port  # noqa: E402
from services.cli.openai_gateway import wait_until_ready  # noqa: E402
from services.cli.supervisor import wait_until_serving  # noqa: E402

AIPERF = "aiperf==0.13.0"
# (label, bench serve key, AIPerf metric, AIPerf statistic)
ROWS = [
    ("TTFT mean (ms)", "mean_ttft_ms", "time_to_first_token", "avg"),
    ("TTFT p50 (ms)", "median_ttft_ms", "time_to_first_token", "p50"),
    ("TTFT p99 (ms)", "p99_ttft_ms", "time_to_first_token", "p99"),
    ("TPOT mean (ms)", "mean_tpot_ms", "inter_token_latency", "avg"),
    ("ITL mean (ms)", "mean_itl_ms", "inter_chunk_latency", "avg"),
    ("ITL p50 (ms)", "median_itl_ms", "inter_chunk_latency", "p50"),
    ("output tok/s", "output_throughput", "output_token_throughput", "avg"),
    ("requests/s", "request_throughput", "request_throughput", "avg"),
]


def aiperf_executable(ns: argparse.Namespace) -> str:
    if ns.aiperf:
        return ns.aiperf
    venv = Path(ns.tools_dir).expanduser() / AIPERF.replace("==", "-")
    exe = venv / "bin" / "aiperf"
    if not exe.exists():
        print(f"installing {AIPERF} into {venv} (once)", file=sys.stderr, flush=True)
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", AIPERF], check=True)
    return str(exe)


def start_server(ns: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, int, int]:
    port, openai_port = free_port(), free_port()
    argv = [sys.executable, "-m", "services", "serve", "--prompt", "", "--port", str(port)]
    argv += ["--engine-addr", f"127.0.0.1:{free_port()}", "--openai-port", str(openai_port)]
    argv += ["--openai-host", "127.0.0.1", *(["--model", ns.model] if ns.model else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "proto")])}
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    ok = wait_until_serving(f"127.0.0.1:{port}", [proc], 900)
    ok = ok and wait_until_ready(f"http://127.0.0.1:{openai_port}", [proc], 300)
    if not ok:
        proc.kill()
        sys.exit(f"the server did not come up; see {log}")
    return proc, port, openai_port


def model_id(openai_port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{openai_port}/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def run_grpc(ns: argparse.Namespace, port: int, work: Path, run: int) -> dict[str, float]:
    name = f"grpc-{run}.json"
    argv = [sys.executable, "-m", "clients", "bench", "serve", "--address", f"127.0.0.1:{port}"]
    argv += ["--num-prompts", str(ns.num_prompts), "--random-input-len", str(ns.input_len)]
    argv += ["--random-output-len", str(ns.output_len), "--max-concurrency", str(ns.concurrency)]
    argv += ["--num-warmups", str(ns.warmups), "--seed", str(run), "--disable-tqdm"]
    argv += ["--save-result", "--result-dir", str(work), "--result-filename", name]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "proto")])}
    subprocess.run(argv, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    result = json.loads((work / name).read_text())
    assert result["failed"] == 0, result.get("errors")
    return {key: float(result[key]) for _, key, _, _ in ROWS}


def run_aiperf(
    ns: argparse.Namespace,
    aiperf: str,
    openai_port: int,
    model: str,
    tokenizer: str,
    work: Path,
    run: int,
) -> dict[str, float]:
    out = work / f"aiperf-{run}"
    argv = [aiperf, "profile", "--model", model, "--url", f"http://127.0.0.1:{openai_port}"]
    argv += ["--endpoint-type", "completions", "--streaming", "--tokenizer", tokenizer]
    argv += ["--request-count", str(ns.num_prompts), "--concurrency", str(ns.concurrency)]
    argv += ["--warmup-request-count", str(ns.warmups), "--random-seed", str(run)]
    argv += ["--prompt-input-tokens-mean", str(ns.input_len), "--prompt-input-tokens-stddev", "0"]
    argv += ["--prompt-output-tokens-mean", str(ns.output_len)]
    argv += ["--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true"]
    argv += ["--use-server-token-count", "--output-artifact-dir", str(out)]
    argv += ["--ui-type", "none", "--no-auto-plot"]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = json.loads((out / "profile_export_aiperf.json").read_text())
    assert result["request_count"]["avg"] == ns.num_prompts, result.get("error_summary")
    return {key: float(result[metric][stat]) for _, key, metric, stat in ROWS}


def report(grpc: list[dict[str, float]], door: list[dict[str, float]]) -> None:
    print(
        f"\n{'metric':<16}{'gRPC (bench serve)':>30}{'OpenAI door (AIPerf)':>30}{'door/gRPC':>20}"
    )
    for label, key, _, _ in ROWS:
        g = [r[key] for r in grpc]
        d = [r[key] for r in door]
        ratios = [b / a for a, b in zip(g, d) if a]
        spread = lambda xs: f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"  # noqa: E731
        print(f"{label:<16}{spread(g):>30}{spread(d):>30}{spread(ratios):>20}")
    print("(median of the runs, range in brackets; ratios are per run)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="(the default model)")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--aiperf", default=None, help="an installed aiperf executable")
    parser.add_argument("--tools-dir", default="~/.cache/pagedserve/bench-tools")
    ns = parser.parse_args()
    aiperf = aiperf_executable(ns)
    with tempfile.TemporaryDirectory(prefix="openai-door-") as tmp:
        work = Path(tmp)
        proc, port, openai_port = start_server(ns, work / "serve.log")
        try:
            model = model_id(openai_port)
            from engine.api.model_files import gguf_cache_path
            from engine.loader.model_dir import resolve_model
            from services.tokenizer_service.model_files import default_model_path

            path = Path(ns.model) if ns.model else default_model_path()
            tokenizer = str(
                gguf_cache_path(path) if path.suffix == ".gguf" else resolve_model(path)
            )
            grpc, door = [], []
            for run in range(ns.runs):
                grpc.append(run_grpc(ns, port, work, run))
                door.append(run_aiperf(ns, aiperf, openai_port, model, tokenizer, work, run))
                print(f"run {run + 1}: gRPC {grpc[-1]}\n       door {door[-1]}", flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    print(
        f"\n{ns.num_prompts} prompts x {ns.input_len} tokens in, {ns.output_len} out "
        f"(ignore_eos), concurrency {ns.concurrency}, {ns.warmups} warmups, model "
        f"{ns.model or 'default'}"
    )
    report(grpc, door)
    return 0


if __name__ == "__main__":
    sys.exit(main())
