"""The tokenizer service's footprint: how fast one more tokenizer replica is ready, and what it
costs in memory (DESIGN.md: the tier that scales out never loads torch).

    python benchmarks/serving/tokenizer_tier.py [--model DIR_OR_GGUF] [--repeats 3]

Starts one engine service (the default model unless --model), then, `--repeats` times, a fresh
`pagedserve tokenizer` process in front of it, and prints per run:

- `listening_s`: from the process's start until its port accepts connections (model files
  read, server started);
- `ready_s`: until its standard health says SERVING (it has also reached the engine);
- `peak_rss_mib`: its VmHWM after it has served Generate, Tokenize and Encode;
- `libtorch_mapped`: whether any libtorch library is in its memory map.

Then the median and the spread (max - min) of the times.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

from benchmarks.serving.proc_cpu import free_port  # noqa: E402
from clients import Client  # noqa: E402
from services.cli.supervisor import wait_until_serving  # noqa: E402


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "proto")])
    return env


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one_run(model: list[str], engine_address: str) -> dict[str, object]:
    port = free_port()
    argv = [sys.executable, "-m", "services", "tokenizer", *model, "--engine-addr"]
    argv += [engine_address, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--log-level", "WARNING"]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=_env(), cwd=ROOT)
    try:
        listening = ready = None
        while ready is None:
            if proc.poll() is not None:
                raise RuntimeError(f"the tokenizer service exited with {proc.returncode}")
            if listening is None and _listening(port):
                listening = time.perf_counter() - start
            if listening is not None and _serving(f"127.0.0.1:{port}"):
                ready = time.perf_counter() - start
            time.sleep(0.02)
        with Client(f"127.0.0.1:{port}", timeout=120) as client:
            client.generate_text("The capital of France is", max_tokens=8, temperature=0)
            client.tokenize("The capital of France is")
            client.encode("The capital of France is")
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        return {
            "listening_s": round(listening, 3),
            "ready_s": round(ready, 3),
            "peak_rss_mib": round(_peak_rss_mib(proc.pid), 1),
            "libtorch_mapped": "libtorch" in maps,
        }
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model directory or .gguf file")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = ["--model", args.model] if args.model else []
    engine_address = f"127.0.0.1:{free_port()}"
    engine = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services",
            "engine",
            *model,
            "--engine-addr",
            engine_address,
            "--log-level",
            "WARNING",
        ],
        env=_env(),
        cwd=ROOT,
    )
    try:
        if not wait_until_serving(engine_address, [engine], 600):
            raise RuntimeError("the engine service did not come up")
        runs = [one_run(model, engine_address) for _ in range(args.repeats)]
    finally:
        engine.terminate()
        engine.wait(60)
    for run in runs:
        print(json.dumps(run))
    for key in ("listening_s", "ready_s", "peak_rss_mib"):
        values = [float(r[key]) for r in runs]  # type: ignore[arg-type]
        print(
            f"{key}: median {statistics.median(values):.2f}, spread {max(values) - min(values):.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
