"""The product as a user starts it, on a GPU: both services with default flags, a chat
answer, then `pagedserve bench serve` at several concurrencies, beside the same requests in
process.

    python benchmarks/gpu/serving_sweep.py                       # 8B shape, 1 16 64 256
    python benchmarks/gpu/serving_sweep.py --shape tiny --concurrency 1 2 --output-len 8

1. A Llama-3.1-8B-shaped directory (benchmarks/gpu/llama8b.py: random weights drawn on the
   device, `--load-format dummy`; the default model's real tokenizer, so the services serve
   text).
2. `pagedserve serve --model DIR --load-format dummy --prompt ""` as README starts it (and
   docker/compose.gpu.yml: no KV-cache byte budget, so the engine sizes its cache from the
   GPU's free memory after a profile step; CUDA graphs on); only the ports are chosen free.
   `pagedserve health --wait`, then `pagedserve generate ... --chat` must answer.
3. For each `--concurrency` c: `pagedserve bench serve` with random `--input-len` /
   `--output-len` prompts (max(8, min(2c, 128), c) of them, all sent at once, at most c in
   flight), reporting TTFT, TPOT and output tok/s, and the CPU seconds each service process
   (engine, tokenizer) used during the level per 1,000 output tokens (psutil: user + system,
   the process and its children; the level's two warm-up requests counted in both).
4. The services stopped, the same requests (the same seed gives the same token ids) through
   `LLM(model=DIR, load_format="dummy")` in this process, c in flight at a time (the LLM's
   engine driven step by step: TTFT and TPOT per request as the services report them), and
   `LLM.generate` of the largest level's requests at once.

`--output-json` writes every figure; `--log-dir` keeps the services' logs and the bench's
JSON results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import psutil

from benchmarks.gpu.llama8b import SHAPES, default_tokenizer_dir, describe, write_model_dir
from benchmarks.serving.proc_cpu import free_port

CHAT_PROMPT = "Why is the sky blue?"
NUM_WARMUPS = 2  # requests bench serve sends first, untimed, at each level


def pagedserve_command() -> list[str]:
    """The installed `pagedserve` command, or the same entry point from the checkout."""
    found = shutil.which("pagedserve")
    return [found] if found else [sys.executable, "-m", "services"]


def num_requests(concurrency: int) -> int:
    return max(8, min(2 * concurrency, 128), concurrency)


class Services:
    """`pagedserve serve` in its own process group, its output in a log file."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.port, engine_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        argv = [
            *pagedserve_command(), "serve", "--model", str(model_dir), "--load-format", "dummy",
            "--prompt", "", "--port", str(self.port),
            "--engine-addr", f"127.0.0.1:{engine_port}",
        ]  # fmt: skip
        self.log_path = log_dir / "services.log"
        self.log = self.log_path.open("w")
        print("$", " ".join(argv), flush=True)
        self.process = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def client(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        argv = [*pagedserve_command(), *args, "--address", self.address]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)

    def processes(self) -> dict[str, psutil.Process]:
        """The engine and tokenizer service processes, by the subcommand they run."""
        found = {}
        for child in psutil.Process(self.process.pid).children():
            cmdline = child.cmdline()
            for name in ("engine", "tokenizer"):
                if name in cmdline:
                    found[name] = child
        return found

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # serve stops its children and returns
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def cpu_seconds(process: psutil.Process) -> float:
    """User + system seconds of the process and its live children."""
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        try:
            times = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def start_services(model_dir: Path, log_dir: Path, startup_s: float) -> tuple[Services, dict]:
    services = Services(model_dir, log_dir)
    start = time.perf_counter()
    health = services.client("health", "--wait", str(startup_s), timeout=startup_s + 30)
    ready_s = time.perf_counter() - start
    if health.returncode != 0:
        services.stop()
        tail = services.log_path.read_text()[-3000:]
        raise RuntimeError(f"the services did not become healthy in {startup_s} s:\n{tail}")
    print(f"services healthy in {ready_s:.1f} s", flush=True)
    chat = services.client(
        "generate", CHAT_PROMPT, "--chat", "--max-tokens", "32", timeout=120
    )  # fmt: skip
    answer = chat.stdout.strip()
    print(f"chat: {CHAT_PROMPT!r} -> {answer!r} (rc {chat.returncode})", flush=True)
    if chat.returncode != 0 or not answer:
        services.stop()
        raise RuntimeError(f"the chat request failed: {chat.stderr[-2000:]}")
    return services, {"ready_s": ready_s, "chat_answer": answer}


def served_level(services: Services, args: argparse.Namespace, c: int, log_dir: Path) -> dict:
    """One concurrency level through `pagedserve bench serve`; the CPU seconds of each
    service process around it."""
    processes = services.processes()
    before = {name: cpu_seconds(p) for name, p in processes.items()}
    name = f"bench_c{c}.json"
    bench = services.client(
        "bench", "serve", "--num-prompts", str(num_requests(c)),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--max-concurrency", str(c), "--request-rate", "inf", "--num-warmups", str(NUM_WARMUPS),
        "--disable-tqdm", "--save-result", "--result-dir", str(log_dir),
        "--result-filename", name,
        timeout=args.level_timeout,
    )  # fmt: skip
    after = {name: cpu_seconds(p) for name, p in processes.items()}
    if bench.returncode != 0:
        raise RuntimeError(f"bench serve at concurrency {c} failed:\n{bench.stderr[-2000:]}")
    result = json.loads((log_dir / name).read_text())
    if result["failed"]:
        raise RuntimeError(f"{result['failed']} requests failed: {result['errors'][:3]}")
    # the CPU seconds include the warm-up requests' tokens too (ignore_eos: output_len each)
    tokens_k = (result["total_output_tokens"] + NUM_WARMUPS * args.output_len) / 1000
    return {
        "requests": result["completed"],
        "ttft_ms": result["median_ttft_ms"],
        "p99_ttft_ms": result["p99_ttft_ms"],
        "tpot_ms": result["median_tpot_ms"],
        "output_tok_s": result["output_throughput"],
        "cpu_s_per_1k_tokens": {n: (after[n] - before[n]) / tokens_k for n in processes},
    }


def in_process_level(llm: Any, requests: list, c: int) -> dict:
    """The requests through the LLM's engine, at most `c` in flight, streamed step by step:
    TTFT and TPOT per request as `bench serve` computes them."""
    from engine import SamplingParams

    engine = llm.llm_engine
    pending = list(enumerate(requests))
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    cpu_before, start = time.process_time(), time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(sent) - len(done) < c:
            i, request = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
            engine.add_request(str(i), {"prompt_token_ids": request.prompt_token_ids}, params)
            sent[str(i)] = time.perf_counter()
        for output in engine.step():
            now, rid = time.perf_counter(), output.request_id
            if output.outputs[0].token_ids and rid not in first:
                first[rid] = now
            if output.finished:
                done[rid] = (now, len(output.outputs[0].token_ids))
    elapsed = time.perf_counter() - start
    cpu_s = time.process_time() - cpu_before
    tokens = sum(n for _, n in done.values())
    ttft = [first[r] - sent[r] for r in done]
    tpot = [(end - first[r]) / (n - 1) for r, (end, n) in done.items() if n > 1]
    return {
        "requests": len(done),
        "ttft_ms": statistics.median(ttft) * 1e3,
        "tpot_ms": statistics.median(tpot) * 1e3 if tpot else None,
        "output_tok_s": tokens / elapsed,
        "cpu_s_per_1k_tokens": {"this process": cpu_s / (tokens / 1000)},
    }


def generate_all(llm: Any, requests: list) -> dict:
    from engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
              for r in requests]  # fmt: skip
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    llm.llm_engine.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"requests": len(requests), "elapsed_s": elapsed, "output_tok_s": tokens / elapsed}


def _row(label: str, r: dict) -> str:
    cpu = ", ".join(f"{n} {v:.2f}" for n, v in r["cpu_s_per_1k_tokens"].items())
    tpot = f"{r['tpot_ms']:7.2f}" if r["tpot_ms"] is not None else "      -"
    return (
        f"{label:>22}: TTFT {r['ttft_ms']:8.1f} ms  TPOT {tpot} ms  "
        f"{r['output_tok_s']:9.1f} output tok/s  CPU s / 1k tokens: {cpu}"
    )


def save(args: argparse.Namespace, results: dict) -> None:
    """Written after every stage: a run cut short by its time limit keeps what it measured."""
    if args.output_json:
        args.output_json.write_text(json.dumps(results, indent=2))


def run_in_process(model_dir: Path, args: argparse.Namespace, vocab: int, results: dict) -> None:
    from clients.bench import random_dataset
    from engine import LLM

    start = time.perf_counter()
    llm = LLM(model=str(model_dir), load_format="dummy")  # the defaults the services use
    results["in_process_ready_s"] = time.perf_counter() - start
    for c in args.concurrency:
        requests = random_dataset(num_requests(c), args.input_len, args.output_len, 0.0, vocab)
        in_process_level(llm, requests[:NUM_WARMUPS], NUM_WARMUPS)  # as bench serve's
        llm.llm_engine.reset_prefix_cache()
        r = in_process_level(llm, requests, c)
        results["levels"][str(c)]["in_process"] = r
        print(_row(f"c={c} in process", r), flush=True)
        save(args, results)
    largest = max(args.concurrency)
    requests = random_dataset(num_requests(largest), args.input_len, args.output_len, 0.0, vocab)
    results["llm_generate"] = generate_all(llm, requests)
    g = results["llm_generate"]
    print(
        f"LLM.generate of the c={largest} requests at once: {g['output_tok_s']:.1f} output "
        f"tok/s ({g['elapsed_s']:.1f} s)",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--tokenizer-dir", type=Path, default=None, help="(the default model's)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--startup-timeout", type=float, default=240.0)
    parser.add_argument("--level-timeout", type=float, default=300.0)
    parser.add_argument("--skip-in-process", action="store_true")
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None, help="services' log, bench JSON")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        log_dir = args.log_dir or Path(tmp) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        model_dir = write_model_dir(
            args.shape, Path(tmp) / args.shape, args.tokenizer_dir or default_tokenizer_dir()
        )
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        print(f"model: {args.shape} ({describe(model_dir)}), random weights", flush=True)
        results: dict[str, Any] = {"shape": args.shape, "vocab_size": vocab, "levels": {}}
        services, startup = start_services(model_dir, log_dir, args.startup_timeout)
        results.update(startup)
        try:
            for c in args.concurrency:
                r = served_level(services, args, c, log_dir)
                results["levels"][str(c)] = {"served": r}
                print(_row(f"c={c} served", r), flush=True)
                save(args, results)
        finally:
            services.stop()
        if not args.skip_in_process:
            run_in_process(model_dir, args, vocab, results)
    save(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
