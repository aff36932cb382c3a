"""The pause a client sees when its stream migrates: one of three engine replicas killed,
stalled or drained under 16 concurrent streams, against an undisturbed run in the same
invocation (issue 34; docs/deployment.md "What survives what").

    python benchmarks/serving/migration.py                       # default model, 3 runs
    python benchmarks/serving/migration.py --model DIR --max-tokens 64 --runs 1

Three engine processes and tokenizer service processes on loopback, all real. Each run
has four phases of `--streams` greedy streams (random token-id prompts, so prefix affinity
spreads them over the replicas, `--max-tokens` each):

    baseline  no fault
    kill      SIGKILL   ─┐ once a third of all the tokens have streamed, to the replica
    stall     SIGSTOP    ├ holding the most streams (the tokenizer service's Health details,
    drain     SIGTERM   ─┘ `inflight=`); SIGCONT / restart on the same port once all end

A stream's figure is the longest gap between two consecutive token messages it receives.
A stream is "migrated" when the tokenizer service logged a migration for it (its one JSON
log line per migration), else "undisturbed". Printed per run and phase: p50 / p99 of that
gap for both groups, and the migrated p50 as a ratio to the baseline phase's p50 of the same
run; then the spread (min..max) over the runs. A stall is noticed after the tokenizer
service's stall timeout: the stall phase goes through a second tokenizer service with
`--engine-stall-timeout` (5 s here, printed), the other phases through one with the default
10 s, and the engines keep their watchdog's default 10 s (on a loaded CPU a prefill of the
default model can run for seconds, which a short timeout takes for a stall). A drain hands
the streams back after `--shutdown-grace`. Both are in the pause.
Every stream must end with all its tokens; errors are counted and printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

from benchmarks.serving.proc_cpu import free_port  # noqa: E402
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402
from services.cli.supervisor import wait_until_serving  # noqa: E402

DEFAULT_STALL_TIMEOUT_S = 10.0  # the tokenizer service's own default
FAULTS = {"kill": signal.SIGKILL, "stall": signal.SIGSTOP, "drain": signal.SIGTERM}
MIGRATED_MSG = "stream migrated to another engine replica"


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "proto")])
    return env


class Engine:
    """One engine replica on a fixed port (restarted on the same one)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.address = f"127.0.0.1:{free_port()}"
        self.proc: subprocess.Popen | None = None
        self.draining = False  # SIGTERM sent: it exits by itself

    def start(self) -> None:
        a = self.args
        argv = [sys.executable, "-m", "services", "engine", "--engine-addr", self.address]
        argv += ["--kv-cache-memory-bytes", str(a.kv_cache_memory_bytes), "--log-level", "WARNING"]
        argv += ["--shutdown-grace", str(a.shutdown_grace)]
        argv += ["--model", a.model] if a.model else []
        self.proc = subprocess.Popen(argv, env=child_env(a.threads), cwd=ROOT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Tokenizer:
    """The tokenizer service, its JSON log read for the migration lines."""

    def __init__(self, args: argparse.Namespace, engines: list[Engine], stall_s: float) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        host, port = self.address.split(":")
        argv = [sys.executable, "-m", "services", "tokenizer", "--host", host, "--port", port]
        argv += ["--engine-addr", ",".join(e.address for e in engines)]
        argv += ["--engine-stall-timeout", str(stall_s)]
        argv += ["--log-format", "json", "--log-level", "INFO"]
        argv += ["--model", args.model] if args.model else []
        self.proc = subprocess.Popen(
            argv, env=child_env(1), cwd=ROOT, stderr=subprocess.PIPE, text=True
        )
        self.migrated: dict[str, list[str]] = {}  # request id -> the reasons of its moves
        threading.Thread(target=self._read_log, daemon=True).start()

    def _read_log(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("msg") == MIGRATED_MSG:
                self.migrated.setdefault(entry["request_id"], []).append(entry["reason"])

    def replicas(self) -> dict[str, str]:
        """Each replica's line of the Health details ("up waiting=... inflight=...")."""
        with grpc.insecure_channel(self.address) as channel:
            stub = generation_pb2_grpc.TextGenerationServiceStub(channel)
            details = stub.Health(common_pb2.HealthRequest(), timeout=30).details
        prefix = "replica."
        return {k.removeprefix(prefix): v for k, v in details.items() if k.startswith(prefix)}

    def wait_all_up(self, engines: list[Engine], timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.replicas().get(e.address, "").startswith("up") for e in engines):
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas not all up: {self.replicas()}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Stream:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.arrivals: list[float] = []  # one per message with tokens
        self.num_tokens = 0
        self.error: str | None = None
        self.done = False

    def longest_gap(self) -> float:
        return max((b - a for a, b in zip(self.arrivals, self.arrivals[1:])), default=0.0)


async def run_phase(
    args, tokenizer: Tokenizer, engines: list[Engine], name: str, run: int
) -> list[Stream]:
    """`args.streams` streams; the fault `name` (or none) midway; every stream to its end.
    The prompts are the same in every run (so is where they go); the request ids differ."""
    rng = random.Random(f"{args.seed}-{name}")
    params = common_pb2.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    streams = [Stream(f"{name}-run{run}-{i}") for i in range(args.streams)]

    async def one(stub, stream: Stream) -> None:
        request = generation_pb2.GenerateRequest(
            request_id=stream.request_id, sampling_params=params
        )
        request.token_ids.ids.extend(rng.randrange(1000, 40000) for _ in range(args.prompt_len))
        try:
            async for response in stub.Generate(request, timeout=3600):
                if response.token_ids:
                    stream.arrivals.append(time.perf_counter())
                    stream.num_tokens += len(response.token_ids)
        except grpc.aio.AioRpcError as exc:
            stream.error = f"{exc.code().name}: {exc.details()}"
        finally:
            stream.done = True

    async def fault() -> None:
        # Midway: a third of all the tokens streamed (some replicas run ahead of others).
        while sum(s.num_tokens for s in streams) < len(streams) * args.max_tokens // 3:
            await asyncio.sleep(0.005)
        inflight = {
            address: int(re.search(r"inflight=(\d+)", line).group(1))
            for address, line in (await asyncio.to_thread(tokenizer.replicas)).items()
        }
        victim = next(e for e in engines if e.address == max(inflight, key=inflight.get))
        victim.draining = name == "drain"
        victim.proc.send_signal(FAULTS[name])
        print(f"  {name}: {FAULTS[name].name} to {victim.address} ({inflight})", flush=True)

    async with grpc.aio.insecure_channel(tokenizer.address) as channel:
        stub = generation_pb2_grpc.TextGenerationServiceStub(channel)
        tasks = [one(stub, s) for s in streams]
        await asyncio.gather(*tasks, *([fault()] if name in FAULTS else []))
    return streams


def recover(tokenizer: Tokenizer, engines: list[Engine], fault: str) -> None:
    """The faulted replica back: continued, or (killed, drained) started again on its
    port once it has exited."""
    for engine in engines:
        assert engine.proc is not None
        if engine.proc.poll() is None and not (fault == "drain" and engine.draining):
            engine.proc.send_signal(signal.SIGCONT)  # a no-op unless it was stopped
            continue
        status = engine.proc.wait(600)
        engine.draining = False
        print(f"  {engine.address} exited with {status}; starting it again", flush=True)
        engine.start()
    tokenizer.wait_all_up(engines)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(streams: list[Stream], migrated: set[str]) -> dict[str, list[float]]:
    groups: dict[str, list[float]] = {"migrated": [], "undisturbed": []}
    for s in streams:
        key = "migrated" if s.request_id in migrated else "undisturbed"
        groups[key].append(s.longest_gap())
    return groups


def fmt(gaps: list[float]) -> str:
    if not gaps:
        return "   -      -   (0)"
    return f"{percentile(gaps, 0.5):6.3f} {percentile(gaps, 0.99):6.3f} ({len(gaps)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default model)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="threads per engine")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    parser.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=5.0,
        help="the tokenizer service's in the stall phase (5; elsewhere and in the engines: 10)",
    )
    parser.add_argument("--shutdown-grace", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(
        f"3 engine replicas, {args.streams} greedy streams x {args.max_tokens} tokens, "
        f"tokenizer --engine-stall-timeout {args.engine_stall_timeout} s in the stall phase "
        f"({DEFAULT_STALL_TIMEOUT_S} s in the others), engine "
        f"--shutdown-grace "
        f"{args.shutdown_grace} s, {args.threads} thread(s) per engine, model "
        f"{args.model or 'default'}",
        flush=True,
    )

    engines = [Engine(args) for _ in range(3)]
    for engine in engines:
        engine.start()
    # Two tokenizer services in front of the same engines: the stall phase's with the short
    # stall timeout, the others' with the default (a long CPU prefill is not a stall).
    default = Tokenizer(args, engines, DEFAULT_STALL_TIMEOUT_S)
    short = Tokenizer(args, engines, args.engine_stall_timeout)
    results: list[dict[str, dict[str, list[float]]]] = []
    errors = 0
    try:
        procs = [e.proc for e in engines] + [default.proc, short.proc]
        for address in [e.address for e in engines] + [default.address, short.address]:
            assert wait_until_serving(address, procs, timeout=900), address
        for tokenizer in (default, short):
            tokenizer.wait_all_up(engines)
        asyncio.run(run_phase(args, default, engines, "warmup", 0))
        for run in range(args.runs):
            figures: dict[str, dict[str, list[float]]] = {}
            for name in ("baseline", *FAULTS):
                tokenizer = short if name == "stall" else default
                streams = asyncio.run(run_phase(args, tokenizer, engines, name, run))
                for s in streams:
                    if s.error or s.num_tokens != args.max_tokens:
                        errors += 1
                        print(f"  {s.request_id}: {s.num_tokens} tokens, {s.error}", flush=True)
                figures[name] = summarize(streams, set(tokenizer.migrated))
                recover(tokenizer, engines, name)
                (short if tokenizer is default else default).wait_all_up(engines)
            results.append(figures)
            report_run(run, figures)
    finally:
        for tokenizer in (default, short):
            tokenizer.stop()
        for engine in engines:
            engine.stop()
    report_spread(results)
    print(f"streams that ended early or with an error: {errors}")


def report_run(run: int, figures: dict[str, dict[str, list[float]]]) -> None:
    base = percentile(figures["baseline"]["undisturbed"], 0.5)
    print(f"run {run + 1}: longest gap between two tokens, seconds: p50 p99 (streams)")
    print(f"  {'baseline':9} undisturbed {fmt(figures['baseline']['undisturbed'])}")
    for name in FAULTS:
        g = figures[name]
        ratio = percentile(g["migrated"], 0.5) / base
        print(
            f"  {name:9} migrated {fmt(g['migrated'])}  x{ratio:5.1f} vs baseline p50   "
            f"undisturbed {fmt(g['undisturbed'])}",
            flush=True,
        )


def report_spread(results: list[dict[str, dict[str, list[float]]]]) -> None:
    def spread(values: list[float], unit: str = "") -> str:
        values = [v for v in values if v == v]  # a run without such streams: nan
        if not values:
            return "-"
        return f"{statistics.median(values):.3f}{unit} ({min(values):.3f}..{max(values):.3f})"

    print(f"\nover {len(results)} run(s): median (min..max)")
    base = [percentile(r["baseline"]["undisturbed"], 0.5) for r in results]
    print(f"  baseline p50 {spread(base)} s")
    for name in FAULTS:
        mig50 = [percentile(r[name]["migrated"], 0.5) for r in results]
        mig99 = [percentile(r[name]["migrated"], 0.99) for r in results]
        und50 = [percentile(r[name]["undisturbed"], 0.5) for r in results]
        ratio = [m / b for m, b in zip(mig50, base, strict=True)]
        print(
            f"  {name:6} migrated p50 {spread(mig50)} s, p99 {spread(mig99)} s, "
            f"p50/baseline {spread(ratio)}; undisturbed p50 {spread(und50)} s"
        )


if __name__ == "__main__":
    main()
