"""The tokenizer service at a GPU's token rate: the real `pagedserve tokenizer` in front of
an engine stand-in that makes tokens at a fixed rate and costs almost nothing
(`paced_engine.py`: the real engine server, a paced engine), with the clients in processes
of their own.

    python benchmarks/serving/tier_at_rate.py                       # 5k, 20k, 50k tokens/s
    python benchmarks/serving/tier_at_rate.py --rates 50000 --stream-interval 16

Each step of the stand-in gives every live request one token, so the aggregate rate is
streams / step period (`--rates` in tokens/s, or `--step-ms`); the tokens are real English
text in the default model's tokenizer, so detokenization costs what it does in use. For each
rate: the stand-in and `pagedserve tokenizer` (the default model's tokenizer, `--engine-addr`
at the stand-in, as a user starts it) are started once, then `--repeats` bursts of
`--streams` requests x `--output-len` tokens, all at once, spread over `--client-procs`
client processes (`rate_client.py`); the stand-in's first step waits until all the
burst's requests are live (grpc.aio takes new calls in one per turn of the tokenizer's
event loop, so 256 calls at once start over seconds while others already stream). Per
burst:

- `target_tokens_per_s` and `tokens_per_s` (output tokens over the burst's wall time, from
  the clients' common start to the last one's end), and `kept_pace` = their ratio (the
  burst's first and last steps count too, so ~`output-len / (output-len + 2)` is a tier that
  kept up);
- `tokenizer_cpu_us_per_token`: the tokenizer service's user + system CPU (/proc, children
  included) over the burst, per output token; `tokenizer_cores`: the same over the wall
  time (1.0: one core busy all along, the most one process with one event loop can do);
- `client_msgs_per_token`: client messages per token (1.0: no merging);
  `engine_msgs_per_token`: Generate messages the tokenizer got from the engine per token
  (its `pagedserve:engine_messages`), `hop1_batches_per_token`: GenerateStream batches;
- `standin_cpu_us_per_token` / `standin_cores`: the stand-in's own CPU (what a real engine
  service's gRPC layer costs on its host, not this process's concern);
  `client_cpu_us_per_token` / `client_cores`: the client processes' (their `process_time`);
- `gap_p50_ms` / `gap_p99_ms`: the gaps between consecutive messages of a stream, over all
  streams, as the clients saw them.

Then the median and the spread (max - min) of each figure per rate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

from benchmarks.serving.paced_engine import encode_english_text  # noqa: E402
from benchmarks.serving.proc_cpu import free_port, process_tree_cpu_s  # noqa: E402
from benchmarks.serving.tier_cost import _hop1_counts  # noqa: E402
from services.cli.supervisor import wait_until_serving  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent
_START_TIMEOUT_S = 300


@dataclass
class Tier:
    """The running stand-in and tokenizer service of one rate."""

    address: str  # the tokenizer service's public API
    metrics_port: int
    standin: subprocess.Popen
    tokenizer: subprocess.Popen
    step_s: float


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "proto")]))


def played_token_ids() -> list[int]:
    """The English text the stand-in plays, in the default model's tokenizer (the one the
    tokenizer service loads when started without `--model`)."""
    from services.tokenizer_service.model_files import load_text_model_files

    return encode_english_text(load_text_model_files(None).tokenizer)


@contextlib.contextmanager
def start_tier(
    ids_file: Path, step_s: float, batch_size: int = 1, stream_interval: int = 1
) -> Iterator[Tier]:
    """`paced_engine.py` at `step_s` (a burst's first step waiting for `batch_size` live
    requests) and `pagedserve tokenizer` in front of it, until the block ends."""
    engine_port, port, metrics_port = free_port(), free_port(), free_port()
    standin_argv = [sys.executable, str(SCRIPTS / "paced_engine.py"), "--port", str(engine_port)]
    standin_argv += ["--step-ms", str(1000 * step_s), "--token-ids-file", str(ids_file)]
    standin_argv += ["--batch-size", str(batch_size)]
    tokenizer_argv = [sys.executable, "-m", "services", "tokenizer", "--log-level", "WARNING"]
    tokenizer_argv += ["--engine-addr", f"127.0.0.1:{engine_port}", "--host", "127.0.0.1"]
    tokenizer_argv += ["--port", str(port), "--metrics-port", str(metrics_port)]
    if stream_interval != 1:
        tokenizer_argv += ["--stream-interval", str(stream_interval)]
    standin = subprocess.Popen(standin_argv, env=_env(), cwd=ROOT)
    tokenizer = None
    try:
        if not wait_until_serving(f"127.0.0.1:{engine_port}", [standin], _START_TIMEOUT_S):
            raise RuntimeError("the engine stand-in did not start")
        tokenizer = subprocess.Popen(tokenizer_argv, env=_env(), cwd=ROOT)
        address = f"127.0.0.1:{port}"
        if not wait_until_serving(address, [standin, tokenizer], _START_TIMEOUT_S):
            raise RuntimeError("the tokenizer service did not start")
        yield Tier(address, metrics_port, standin, tokenizer, step_s)
    finally:
        for child in (tokenizer, standin):
            if child is not None:
                child.terminate()
                child.wait(60)


def run_burst(
    tier: Tier,
    prompts_file: Path,
    num_streams: int,
    output_len: int,
    client_procs: int,
    texts: bool = False,
) -> tuple[dict, list[str]]:
    """One burst of `num_streams` requests over `client_procs` client processes; (figures,
    the streams' texts when `texts`)."""
    base, extra = divmod(num_streams, client_procs)
    shares = [base + (i < extra) for i in range(client_procs)]
    clients = []
    first = 0
    for count in shares:
        argv = [sys.executable, str(SCRIPTS / "rate_client.py"), "--address", tier.address]
        argv += ["--prompts-file", str(prompts_file), "--first", str(first)]
        argv += ["--count", str(count), "--output-len", str(output_len)]
        if texts:
            argv.append("--texts")
        clients.append(
            subprocess.Popen(
                argv, env=_env(), cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
        )
        first += count
    try:
        for client in clients:
            if client.stdout.readline().strip() != "ready":
                raise RuntimeError("a client process did not start")
        counts = _hop1_counts(tier.metrics_port)
        cpu = (process_tree_cpu_s(tier.tokenizer.pid), process_tree_cpu_s(tier.standin.pid))
        start = time.perf_counter()
        for client in clients:
            client.stdin.write("go\n")
            client.stdin.flush()
        reports = [json.loads(client.stdout.readline()) for client in clients]
        wall = time.perf_counter() - start
        used = (
            process_tree_cpu_s(tier.tokenizer.pid) - cpu[0],
            process_tree_cpu_s(tier.standin.pid) - cpu[1],
        )
        after = _hop1_counts(tier.metrics_port)
    finally:
        for client in clients:
            client.stdin.close()
            client.wait(60)
    tokens = sum(r["tokens"] for r in reports)
    wrong = [i for r in reports for i in r["wrong_ends"]]
    if tokens != num_streams * output_len or wrong:
        raise RuntimeError(f"{tokens} tokens came back; streams ended wrong: {wrong[:10]}")
    gaps = sorted(g for r in reports for g in r["gaps"])
    client_cpu = sum(r["cpu_s"] for r in reports)
    target = num_streams / tier.step_s
    figures = {
        "target_tokens_per_s": target,
        "tokens_per_s": tokens / wall,
        "kept_pace": tokens / wall / target,
        "tokenizer_cpu_us_per_token": 1e6 * used[0] / tokens,
        "tokenizer_cores": used[0] / wall,
        "client_msgs_per_token": sum(r["messages"] for r in reports) / tokens,
        "engine_msgs_per_token": (after[0] - counts[0]) / tokens,
        "hop1_batches_per_token": (after[1] - counts[1]) / tokens,
        "standin_cpu_us_per_token": 1e6 * used[1] / tokens,
        "standin_cores": used[1] / wall,
        "client_cpu_us_per_token": 1e6 * client_cpu / tokens,
        "client_cores": client_cpu / wall,
        "gap_p50_ms": 1e3 * _percentile(gaps, 0.50),
        "gap_p99_ms": 1e3 * _percentile(gaps, 0.99),
    }
    return figures, [t for r in reports for t in r.get("texts", [])]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


def make_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    """Random token-id prompts (the stand-in reads only their length and where their text
    starts: `paced_engine.start_offset`)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(num)]


def _summary(rate: float, runs: list[dict]) -> dict[str, float]:
    medians = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        medians[key] = statistics.median(values)
        spread = max(values) - min(values)
        print(f"rate {rate:.0f} {key}: median {medians[key]:.3f}, spread {spread:.3f}")
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument(
        "--rates", default="5000,20000,50000", help="target tokens/s, comma-separated"
    )
    parser.add_argument(
        "--step-ms", type=float, default=None, help="the step period instead of --rates"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--client-procs", type=int, default=2, help="client processes (2)")
    parser.add_argument(
        "--stream-interval", type=int, default=1, help="the tokenizer's --stream-interval (1)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write every run here")
    args = parser.parse_args()
    for name in ("streams", "output_len", "input_len", "repeats", "client_procs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.step_ms is not None:
        if args.step_ms <= 0:
            parser.error(f"--step-ms must be > 0, got {args.step_ms}")
        steps = [args.step_ms / 1000.0]
    else:
        try:
            rates = [float(r) for r in args.rates.split(",") if r.strip()]
        except ValueError:
            parser.error(f"--rates must be numbers of tokens/s, got {args.rates!r}")
        if not rates or min(rates) <= 0:
            parser.error(f"--rates must be > 0, got {args.rates!r}")
        steps = [args.streams / r for r in rates]
    client_procs = min(args.client_procs, args.streams)
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="tier-at-rate-") as tmp:
        ids_file, prompts_file = Path(tmp) / "ids.json", Path(tmp) / "prompts.json"
        ids_file.write_text(json.dumps(played_token_ids()))
        prompts = make_prompts(args.streams, args.input_len, seed=0)
        prompts_file.write_text(json.dumps(prompts))
        for step_s in steps:
            with start_tier(ids_file, step_s, args.streams, args.stream_interval) as tier:
                run_burst(tier, prompts_file, args.streams, 4, client_procs)  # warm-up
                runs = []
                for _ in range(args.repeats):
                    figures, _ = run_burst(
                        tier, prompts_file, args.streams, args.output_len, client_procs
                    )
                    print(
                        json.dumps({k: float(f"{v:.4g}") for k, v in figures.items()}), flush=True
                    )
                    runs.append(figures)
            rate = args.streams / step_s
            results[f"{rate:.0f}"] = runs
            _summary(rate, runs)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
