"""How long an engine service process takes to start, from the spawn of `pagedserve engine`
until standard health says SERVING (wall and the process's CPU seconds) and until its first
Generate has answered, its peak memory, and how long it takes to stop.

    python benchmarks/serving/service_start.py [--model DIR_OR_GGUF | --model default]
                                               [--repeats 3] [--compare OTHER_CHECKOUT]
                                               [--tensor-parallel-size N]
                                               [--pipeline-parallel-size N]
                                               [--start-methods forkserver,spawn]

Without --model, the model is the shape the service tests start (a random Llama: hidden 64,
2 layers, the default model's vocabulary of 49,152 tokens), written to a temporary folder;
`--model default` starts the default model (SmolLM2-135M, its converted cache entry made
once before the runs). Each run is a fresh process (`--log-level WARNING`, a 16 MiB KV cache
as the tests give it); the script prints per run `listening_s` (the port accepts
connections), `serving_s`, `cpu_s` (user + system CPU of the process when SERVING is seen),
`generate_s` (spawn until a first Generate of 8 prompt tokens and 4 greedy output tokens,
sent once SERVING is seen, has finished), `peak_rss_mib` (VmHWM after it) and `stop_s`
(from SIGTERM, sent at once, until the idle process has exited with status 0), then the
median and spread of each. With --compare, the same runs start the engine of another
checkout too (its root on PYTHONPATH and as the working directory), the two alternating, and
the script prints this checkout / the other for each median. With a tensor/pipeline-parallel
size the engine runs its ranks in processes of their own, and `cpu_s` counts the whole tree
(service, rank forkserver, ranks); --start-methods starts them each way in turn
(`PAGEDSERVE_WORKER_MULTIPROC_METHOD`) and prints the first method / the second.

Where one start's time goes: `python -X importtime -m services engine ...` (the imports) and
cProfile of `AsyncLLMEngine.from_engine_args` (docs/benchmarks.md, "Engine start-up").
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from benchmarks.serving.proc_cpu import free_port, process_tree_cpu_s

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("listening_s", "serving_s", "cpu_s", "generate_s", "peak_rss_mib", "stop_s")


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def write_test_model(path: Path) -> Path:
    """The service tests' model shape (tests/services/conftest.py), without tokenizer files:
    the engine service never loads one."""
    import engine  # noqa: F401  (first: it sets libgomp's spin count before torch loads)
    from tests.model_utils import TOKENIZER_VOCAB_SIZE, make_tiny_llama

    return make_tiny_llama(path, vocab_size=TOKENIZER_VOCAB_SIZE, max_position_embeddings=4096)


def first_generate(address: str) -> None:
    """One greedy Generate on the engine API, read to its end."""
    import grpc

    from pagedserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    request = engine_pb2.EngineGenerateRequest(
        request_id="first",
        prompt_token_ids=list(range(1, 9)),
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
    )
    with grpc.insecure_channel(address) as channel:
        responses = list(engine_pb2_grpc.EngineServiceStub(channel).Generate(request, timeout=600))
    if not responses:
        raise RuntimeError("the first Generate answered nothing")


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmHWM in /proc status")


def default_model_dir() -> str:
    """The default model's converted directory (converted once, here, if it is not yet)."""
    from engine.loader.model_dir import resolve_model

    return str(resolve_model(None))


def one_start(
    root: Path, model: str, extra_args: list[str], extra_env: dict[str, str]
) -> dict[str, float]:
    """Starts `root`'s `pagedserve engine` on `model` once; stops it (SIGTERM) when SERVING."""
    from services.cli.supervisor import wait_until_serving

    port = free_port()
    address = f"127.0.0.1:{port}"
    argv = [sys.executable, "-m", "services", "engine", "--model", model]
    argv += ["--engine-addr", address, "--kv-cache-memory-bytes", str(16 << 20)]
    argv += ["--log-level", "WARNING", *extra_args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "proto")]))
    env.update(extra_env)
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=root)
    try:
        listening = None
        while listening is None:
            if proc.poll() is not None:
                raise RuntimeError(f"the engine service exited with {proc.returncode}")
            if _listening(port):
                listening = time.perf_counter() - start
            time.sleep(0.02)
        # The standard health service, polled as the tests and `pagedserve serve` poll it.
        if not wait_until_serving(address, [proc], 600):
            raise RuntimeError("the engine service did not reach SERVING")
        serving = time.perf_counter() - start
        cpu = process_tree_cpu_s(proc.pid)
        first_generate(address)
        generate = time.perf_counter() - start
        peak_rss = _peak_rss_mib(proc.pid)
        stopping = time.perf_counter()
        proc.terminate()
        if proc.wait(120) != 0:
            raise RuntimeError(f"the engine service exited with {proc.returncode} on SIGTERM")
        stop = time.perf_counter() - stopping
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
    return {
        "listening_s": round(listening, 3),
        "serving_s": round(serving, 3),
        "cpu_s": cpu,
        "generate_s": round(generate, 3),
        "peak_rss_mib": peak_rss,
        "stop_s": round(stop, 3),
    }


def _summary(name: str, runs: list[dict[str, float]]) -> dict[str, float]:
    medians = {}
    for key in KEYS:
        values = [run[key] for run in runs]
        medians[key] = statistics.median(values)
        print(
            f"{name:10s} {key}: median {medians[key]:.2f}, "
            f"spread {max(values) - min(values):.2f}, runs {values}"
        )
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="a model directory or .gguf file, or 'default'"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--compare", default=None, help="another checkout whose engine to start too"
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument(
        "--start-methods",
        default=None,
        help="comma-separated PAGEDSERVE_WORKER_MULTIPROC_METHOD values to alternate",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    extra_args = ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    extra_args += ["--pipeline-parallel-size", str(args.pipeline_parallel_size)]
    checkouts: dict[str, tuple[Path, dict[str, str]]] = {"this": (ROOT, {})}
    if args.compare:
        other = Path(args.compare).resolve()
        if not (other / "services" / "__main__.py").is_file():
            parser.error(f"--compare: {other} is not a pagedserve checkout")
        checkouts["other"] = (other, {})
    if args.start_methods:
        if args.compare:
            parser.error("--start-methods and --compare: one comparison at a time")
        methods = [m.strip() for m in args.start_methods.split(",") if m.strip()]
        if len(methods) != 2 or len(set(methods)) != 2:
            parser.error(f"--start-methods: two different methods, got {args.start_methods!r}")
        env = "PAGEDSERVE_WORKER_MULTIPROC_METHOD"
        checkouts = {m: (ROOT, {env: m}) for m in methods}
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "default":
            model = default_model_dir()
        else:
            model = args.model or str(write_test_model(Path(tmp) / "tiny"))
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
        for _ in range(args.repeats):
            for name, (root, extra_env) in checkouts.items():
                run = one_start(root, model, extra_args, extra_env)
                runs[name].append(run)
                print(json.dumps({"variant": name, **run}), flush=True)
    medians = {name: _summary(name, name_runs) for name, name_runs in runs.items()}
    if len(medians) == 2:
        first, second = medians
        for key in KEYS:
            ratio = medians[first][key] / medians[second][key]
            print(f"{first}/{second} {key}: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
