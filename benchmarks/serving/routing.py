"""Routing over engine replicas: prefix affinity vs round robin vs one engine, same run.

    python benchmarks/serving/routing.py            # default model, 8 system prompts x 8 questions

A shared-prefix workload: `--num-prefixes` system prompts of `--prefix-len` tokens, each
followed by `--num-questions` different questions of `--question-len` tokens; the requests
arrive interleaved (shuffled, `--seed`), `--concurrency` at a time, through the tokenizer
service (token-id input, `--max-tokens` greedy tokens each). Two engine processes serve
three configurations in turn, each from a cold prefix cache (a `FlushCache` over vLLM's
engine protocol before each): the tokenizer service in front of one engine, of both with
round robin, and of both with prefix affinity. Printed per configuration: the prefix-cache
hit rate (hit / queried prompt tokens, summed over the engines' `/metrics`) and the mean
time to first token seen by the client.

Both engines share the machine: each gets `--threads` threads (OMP_NUM_THREADS), the same in
every configuration, so the comparison is about where requests go, not about cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2_grpc  # noqa: E402

from benchmarks.serving.proc_cpu import free_port  # noqa: E402
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402
from services.cli.supervisor import wait_until_serving  # noqa: E402


class Child:
    """A `pagedserve` service as a child process."""

    def __init__(self, argv: list[str], threads: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PAGEDSERVE_LOG_LEVEL="WARNING")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "proto")])
        self.proc = subprocess.Popen([sys.executable, "-m", "services", *argv], env=env, cwd=ROOT)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_engine(args: argparse.Namespace) -> tuple[Child, str, int]:
    port, metrics_port = free_port(), free_port()
    argv = ["engine", "--engine-addr", f"127.0.0.1:{port}", "--metrics-port", str(metrics_port)]
    argv += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    argv += ["--model", args.model] if args.model else []
    return Child(argv, args.threads), f"127.0.0.1:{port}", metrics_port


def start_tokenizer(args: argparse.Namespace, engines: list[str], policy: str) -> tuple[Child, str]:
    port = free_port()
    argv = ["tokenizer", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--engine-addr", ",".join(engines), "--route-policy", policy]
    argv += ["--model", args.model] if args.model else []
    return Child(argv, 1), f"127.0.0.1:{port}"


def prefix_counters(metrics_ports: list[int]) -> tuple[float, float]:
    """(hit, queried) prompt tokens, summed over the engines."""
    hits = queries = 0.0
    for port in metrics_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "pagedserve:prefix_cache_hits_total":
                    hits += sample.value
                elif sample.name == "pagedserve:prefix_cache_queries_total":
                    queries += sample.value
    return hits, queries


def flush_caches(engines: list[str]) -> None:
    for address in engines:
        with grpc.insecure_channel(address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            reply = stub.FlushCache(smg_common_pb2.FlushCacheRequest(), timeout=30)
            assert reply.success, f"{address}: {reply.message}"


def make_workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    prefixes = [tokens(args.prefix_len) for _ in range(args.num_prefixes)]
    prompts = [p + tokens(args.question_len) for p in prefixes for _ in range(args.num_questions)]
    rng.shuffle(prompts)  # interleaved arrivals
    return prompts


async def run_workload(address: str, prompts: list[list[int]], args) -> list[float]:
    """Time to first token of each request, seconds."""
    limit = asyncio.Semaphore(args.concurrency)
    params = common_pb2.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.TextGenerationServiceStub(channel)

        async def one(prompt: list[int]) -> float:
            async with limit:
                req = generation_pb2.GenerateRequest(sampling_params=params)
                req.token_ids.ids.extend(prompt)
                start = time.perf_counter()
                ttft = None
                async for _ in stub.Generate(req, timeout=600):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                assert ttft is not None
                return ttft

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def run_config(args, name, engines, metrics_ports, policy, prompts) -> tuple[float, float]:
    flush_caches(engines)
    child, address = start_tokenizer(args, engines, policy)
    try:
        assert wait_until_serving(address, [child.proc], timeout=300), f"{name}: not serving"
        hits0, queries0 = prefix_counters(metrics_ports)
        ttfts = asyncio.run(run_workload(address, prompts, args))
        hits1, queries1 = prefix_counters(metrics_ports)
    finally:
        child.stop()
    hit_rate = (hits1 - hits0) / max(queries1 - queries0, 1.0)
    return hit_rate, sum(ttfts) / len(ttfts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default model)")
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--num-questions", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=400)
    parser.add_argument("--question-len", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="threads per engine")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    prompts = make_workload(args)
    started = [start_engine(args) for _ in range(2)]
    children = [child for child, _, _ in started]
    engines = [address for _, address, _ in started]
    metrics_ports = [port for _, _, port in started]
    try:
        for address in engines:
            procs = [child.proc for child in children]
            assert wait_until_serving(address, procs, timeout=600), f"{address}: not serving"
        results = {}
        for name, used, policy in (
            ("one engine", engines[:1], "affinity"),
            ("2 engines, round robin", engines, "round_robin"),
            ("2 engines, prefix affinity", engines, "affinity"),
        ):
            ports = metrics_ports[: len(used)]
            results[name] = run_config(args, name, used, ports, policy, prompts)
            hit, ttft = results[name]
            print(f"{name}: hit rate {hit:.1%}, mean TTFT {ttft * 1000:.0f} ms", flush=True)
    finally:
        for child in children:
            child.stop()

    base_hit, base_ttft = results["one engine"]
    print(
        f"\n{args.num_prefixes} prefixes x {args.num_questions} questions, prefix "
        f"{args.prefix_len} + question {args.question_len} tokens, {args.max_tokens} output "
        f"tokens, concurrency {args.concurrency}, {args.threads} thread(s) per engine"
    )
    print(f"{'configuration':28} {'hit rate':>9} {'vs one':>8} {'mean TTFT':>10} {'vs one':>8}")
    for name, (hit, ttft) in results.items():
        print(
            f"{name:28} {hit:9.1%} {hit / base_hit:8.2f} {ttft * 1000:8.0f}ms "
            f"{ttft / base_ttft:8.2f}"
        )


if __name__ == "__main__":
    main()
