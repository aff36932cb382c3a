"""What the serving tier itself costs: a model that costs (almost) nothing behind the real
services, so what is left is the two gRPC hops, detokenization and the client.

    python benchmarks/serving/tier_cost.py                  # 64 streams x 256 tokens, 3 runs
    python benchmarks/serving/tier_cost.py --workers 2 --channels 8   # 2 tokenizer processes

The zero-cost model: a random Llama with 1 layer, hidden size 64 and the default model's
tokenizer (49,152 tokens, so the head still costs something), written to a temporary Hugging
Face directory. First in-process `LLM.generate` over the same prompts (the baseline: what the
engine costs without any service), then `pagedserve engine` + `pagedserve tokenizer` as
child processes and an asyncio client in this process streaming all prompts at once through
the public API (random token-id prompts, greedy, `ignore_eos`). Per run it prints:

- `tokens_per_s`: output tokens over the wall time of the whole burst;
- `client_msgs_per_token` / `engine_msgs_per_token`: messages the client got, and Generate
  messages the tokenizer service got from the engine (its `pagedserve:engine_messages`
  counter: per request, whatever carried them), per token;
- `hop1_msgs_per_token`: gRPC messages on the engine -> tokenizer hop per token: the
  batches of the multiplexed GenerateStream calls
  (`pagedserve:engine_replica_stream_batches`) where the tokenizer uses them, else (per-request
  Generate calls, `--per-request-calls`, or a tree without the call) the Generate messages;
- `cpu_us_per_token` for each process: user + system CPU time over the run (/proc/<pid>/stat
  of the real processes, their children included; the client's own `process_time`) per
  output token; `engine_loop_cpu_us_per_token`: the engine service's main thread alone,
  its asyncio event loop (the gRPC servicer's Python work; the engine step runs on other
  threads). On a machine with few cores CPU time is the comparable figure: the wall
  time also counts waiting for a core.

`--openai`: the same burst through the OpenAI door too, `pagedserve gateway` (the smg
gateway, over vLLM's engine protocol) in front of a fresh `pagedserve engine`, streamed
`/v1/completions` (the prompts decoded to text: smg takes no token ids) from one client
thread per stream; smg's CPU stands
where the tokenizer service's did, and a message is an SSE chunk.

Then the median and the spread (max - min) of each figure over the runs, and the served
throughput as a share of `LLM.generate`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

from benchmarks.serving.proc_cpu import (  # noqa: E402
    free_port,
    main_thread_cpu_s,
    process_tree_cpu_s,
)
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402
from services.cli.supervisor import wait_until_serving  # noqa: E402


def write_zero_cost_model(path: Path) -> Path:
    """1 layer, hidden 64, the default model's tokenizer and vocabulary; random weights."""
    import engine  # noqa: F401  (first: it sets libgomp's spin count before torch loads)
    from tests.model_utils import make_tiny_llama

    return make_tiny_llama(
        path,
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        with_tokenizer=True,
        max_position_embeddings=2048,
    )


def make_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(num)]


def run_in_process(model: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model=str(model), max_num_seqs=args.max_num_seqs, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:2], params, use_tqdm=False)  # warm-up
    runs = []
    for _ in range(args.repeats):
        cpu, start = time.process_time(), time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        runs.append({"tokens_per_s": num_tokens / wall, "cpu_us_per_token": 1e6 * cpu / num_tokens})
    del llm
    gc.collect()
    return {"runs": runs}


async def _stream_all(
    address: str, prompts: list[list[int]], output_len: int, num_channels: int = 1
) -> tuple[int, int]:
    """All prompts at once, spread over `num_channels` connections (tokenizer workers
    share out connections, not calls); (output tokens, messages) received."""
    channels = [grpc.aio.insecure_channel(address) for _ in range(num_channels)]
    stubs = [generation_pb2_grpc.TextGenerationServiceStub(c) for c in channels]
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> tuple[int, int]:
        request = generation_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=prompt), sampling_params=params
        )
        num_tokens = num_messages = 0
        async for response in stubs[i % num_channels].Generate(request):
            num_tokens += len(response.token_ids)
            num_messages += 1
        return num_tokens, num_messages

    try:
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        for channel in channels:
            await channel.close()
    return sum(t for t, _ in results), sum(m for _, m in results)


def _counter(metrics_port: int, name: str) -> float:
    """A counter of the tokenizer service's /metrics, summed over its labels and workers
    (NaN if it has none)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{name}_total ", f"{name}_total{{"))
    ]
    return sum(values) if values else float("nan")


def _hop1_counts(metrics_port: int) -> tuple[float, float]:
    """(Generate messages, GenerateStream batches) the tokenizer service has received."""
    return (
        _counter(metrics_port, "pagedserve:engine_messages"),
        _counter(metrics_port, "pagedserve:engine_replica_stream_batches"),
    )


def run_services(model: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    port, engine_port, metrics_port = free_port(), free_port(), free_port()
    common = ["--model", str(model), "--log-level", "WARNING"]
    common += ["--engine-addr", f"127.0.0.1:{engine_port}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "proto")]))
    base = [sys.executable, "-m", "services"]
    engine_argv = [*base, "engine", *common, f"--max-num-seqs={args.max_num_seqs}", "--seed=0"]
    tokenizer_argv = [*base, "tokenizer", *common, "--port", str(port), "--host", "127.0.0.1"]
    tokenizer_argv += ["--metrics-port", str(metrics_port)]
    if args.workers is not None:
        tokenizer_argv += ["--workers", str(args.workers)]
    if args.per_request_calls:
        tokenizer_argv += ["--engine-per-request-calls"]
    if args.stream_interval != 1:
        tokenizer_argv += ["--stream-interval", str(args.stream_interval)]
    engine = subprocess.Popen(engine_argv, env=env, cwd=ROOT)
    tokenizer = subprocess.Popen(tokenizer_argv, env=env, cwd=ROOT)
    address = f"127.0.0.1:{port}"
    runs = []
    try:
        if not wait_until_serving(address, [engine, tokenizer], timeout=900):
            raise RuntimeError("the services did not become healthy")
        asyncio.run(_stream_all(address, prompts[:4], 8))  # warm-up
        for _ in range(args.repeats):
            before = _hop1_counts(metrics_port)
            cpu = (
                process_tree_cpu_s(engine.pid),
                process_tree_cpu_s(tokenizer.pid),
                time.process_time(),
                main_thread_cpu_s(engine.pid),
            )
            start = time.perf_counter()
            num_tokens, num_messages = asyncio.run(
                _stream_all(address, prompts, args.output_len, args.channels)
            )
            wall = time.perf_counter() - start
            used = (
                process_tree_cpu_s(engine.pid) - cpu[0],
                process_tree_cpu_s(tokenizer.pid) - cpu[1],
                time.process_time() - cpu[2],
                main_thread_cpu_s(engine.pid) - cpu[3],
            )
            after = _hop1_counts(metrics_port)
            engine_msgs = after[0] - before[0]
            batches = after[1] - before[1]  # NaN: no multiplexed call in this tree
            hop1_msgs = batches if batches > 0 else engine_msgs
            if num_tokens != len(prompts) * args.output_len:
                raise RuntimeError(f"{num_tokens} tokens came back")
            runs.append(
                {
                    "tokens_per_s": num_tokens / wall,
                    "client_msgs_per_token": num_messages / num_tokens,
                    "engine_msgs_per_token": engine_msgs / num_tokens,
                    "hop1_msgs_per_token": hop1_msgs / num_tokens,
                    "engine_cpu_us_per_token": 1e6 * used[0] / num_tokens,
                    "engine_loop_cpu_us_per_token": 1e6 * used[3] / num_tokens,
                    "tokenizer_cpu_us_per_token": 1e6 * used[1] / num_tokens,
                    "client_cpu_us_per_token": 1e6 * used[2] / num_tokens,
                }
            )
    finally:
        for child in (tokenizer, engine):
            child.terminate()
            child.wait(60)
    return {"runs": runs}


def _stream_openai(port: int, model: Path, prompts: list[str], output_len: int) -> tuple:
    """All prompts at once through smg's `/v1/completions` (streamed), one thread each;
    (output tokens, SSE chunks with text) received."""
    from concurrent.futures import ThreadPoolExecutor

    def one(prompt: str) -> tuple[int, int]:
        body = {
            "model": str(model),
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        num_tokens = num_chunks = 0
        with urllib.request.urlopen(req, timeout=600) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    num_chunks += 1
                if chunk.get("usage"):
                    num_tokens = chunk["usage"]["completion_tokens"]
        return num_tokens, num_chunks

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, prompts))
    return sum(t for t, _ in results), sum(c for _, c in results)


def run_openai(model: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """The same burst through the OpenAI door: `pagedserve gateway` (smg) in front of
    `pagedserve engine`, over vLLM's engine protocol; smg's process tree stands where the
    tokenizer service stood. smg takes text prompts only: the token-id prompts decoded."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    texts = [tokenizer.decode(p) for p in prompts]
    port, engine_port = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "proto")]))
    base = [sys.executable, "-m", "services"]
    engine_argv = [*base, "engine", "--model", str(model), "--log-level", "WARNING"]
    engine_argv += ["--engine-addr", f"127.0.0.1:{engine_port}"]
    engine_argv += [f"--max-num-seqs={args.max_num_seqs}", "--seed=0"]
    gateway_argv = [*base, "gateway", "--engine-addr", f"127.0.0.1:{engine_port}"]
    gateway_argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
    engine = subprocess.Popen(engine_argv, env=env, cwd=ROOT)
    runs = []
    gateway = None
    try:
        if not wait_until_serving(f"127.0.0.1:{engine_port}", [engine], timeout=900):
            raise RuntimeError("the engine service did not become healthy")
        gateway = subprocess.Popen(gateway_argv, env=env, cwd=ROOT)
        deadline = time.monotonic() + 300
        while True:  # smg is ready once a completion goes through
            try:
                _stream_openai(port, model, texts[:1], 2)
                break
            except OSError:
                if time.monotonic() > deadline or gateway.poll() is not None:
                    raise RuntimeError("the gateway did not come up") from None
                time.sleep(1.0)
        for _ in range(args.repeats):
            cpu = (
                process_tree_cpu_s(engine.pid),
                process_tree_cpu_s(gateway.pid),
                time.process_time(),
            )
            start = time.perf_counter()
            num_tokens, num_chunks = _stream_openai(port, model, texts, args.output_len)
            wall = time.perf_counter() - start
            used = (
                process_tree_cpu_s(engine.pid) - cpu[0],
                process_tree_cpu_s(gateway.pid) - cpu[1],
                time.process_time() - cpu[2],
            )
            runs.append(
                {
                    "tokens_per_s": num_tokens / wall,
                    "client_msgs_per_token": num_chunks / num_tokens,
                    "engine_cpu_us_per_token": 1e6 * used[0] / num_tokens,
                    "gateway_cpu_us_per_token": 1e6 * used[1] / num_tokens,
                    "client_cpu_us_per_token": 1e6 * used[2] / num_tokens,
                }
            )
    finally:
        for child in (gateway, engine):
            if child is not None:
                child.terminate()
                child.wait(60)
    return {"runs": runs}


def _summary(name: str, runs: list[dict]) -> dict[str, float]:
    medians = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        medians[key] = statistics.median(values)
        print(f"{name} {key}: median {medians[key]:.2f}, spread {max(values) - min(values):.2f}")
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--workers", type=int, default=None, help="the tokenizer's --workers (its default)"
    )
    parser.add_argument(
        "--channels", type=int, default=1, help="client connections the streams share (1)"
    )
    parser.add_argument("--skip-in-process", action="store_true")
    parser.add_argument(
        "--per-request-calls",
        action="store_true",
        help="the tokenizer's --engine-per-request-calls (one Generate call per request)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the tokenizer's --stream-interval (tokens per client message; 1)",
    )
    parser.add_argument(
        "--openai", action="store_true", help="also through the OpenAI door (smg gateway)"
    )
    args = parser.parse_args()
    prompts = make_prompts(args.streams, args.input_len, seed=0)
    with tempfile.TemporaryDirectory(prefix="tier-cost-") as tmp:
        model = write_zero_cost_model(Path(tmp) / "zero-cost")
        if not args.skip_in_process:
            offline = run_in_process(model, prompts, args)
            for run in offline["runs"]:
                print("LLM.generate", json.dumps({k: round(v, 2) for k, v in run.items()}))
        served = run_services(model, prompts, args)
        door = run_openai(model, prompts, args) if args.openai else None
    for run in served["runs"]:
        print("services", json.dumps({k: round(v, 3) for k, v in run.items()}))
    served_median = _summary("services", served["runs"])
    if door is not None:
        for run in door["runs"]:
            print("openai door", json.dumps({k: round(v, 3) for k, v in run.items()}))
        _summary("openai door", door["runs"])
    if not args.skip_in_process:
        offline_median = _summary("LLM.generate", offline["runs"])
        share = served_median["tokens_per_s"] / offline_median["tokens_per_s"]
        above = served_median["engine_cpu_us_per_token"] - offline_median["cpu_us_per_token"]
        print(f"served tokens/s: {100 * share:.1f} % of LLM.generate's (goal >= 80 %)")
        print(f"engine service CPU above LLM.generate: {above:.1f} us per token (goal <= 15)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
