"""What one streamed gRPC message costs in Python's `grpc.aio`, with nothing else in the way:
the floor under each hop of the serving tier (benchmarks/serving/tier_cost.py).

    python benchmarks/serving/grpc_stream_floor.py [--streams 64] [--tokens 256] [--repeats 3]
        [--tokens-per-message 1,8,16] [--message public|engine] [--step-ms 0]

A server process whose Generate handler only writes messages, and a client in this process
that reads `--streams` such calls at once. `--message public` (the default) is the client
hop the tokenizer service pays: the public `GenerateResponse` (request id, index, a few
characters of text, k token ids, usage), written by a `TextGenerationService.Generate`;
`--message engine` is the engine-shaped `EngineGenerateResponse` of the internal hop. Each
call streams `--tokens` tokens, k per message, for each k of `--tokens-per-message`: as fast
as the calls take them, or with `--step-ms S` at an engine's cadence (every call writes its
next message when the next step comes, every S ms, as the tokenizer service relays each
engine batch; the tier's 64 streams at ~2,000 tokens/s are ~30 ms steps).

Per k and run it prints messages/s, the CPU microseconds per message and per token of the
server (/proc/<pid>/stat) and of the client (`process_time`), and the server's CPU split
by thread: the event loop's (`main`) and grpc's own threads (the completion-queue poller
that wakes the loop, the event engine's workers). Then the median and spread (max - min)
of each figure. A hop that sends one message per token costs at least the server's figure
per token; with k tokens per message, its per-message figure over k.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

from benchmarks.serving.proc_cpu import process_cpu_s  # noqa: E402
from pagedserve.v1 import (  # noqa: E402
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
)

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _messages(request_id: str, num_tokens: int, k: int, public: bool) -> list:
    """The call's messages, built ahead: the floor is the write, not the builder."""
    cls = generation_pb2.GenerateResponse if public else engine_pb2.EngineGenerateResponse
    out = []
    for start in range(0, num_tokens, k):
        ids = list(range(start, min(start + k, num_tokens)))
        msg = cls(
            request_id=request_id,
            token_ids=ids,
            usage=common_pb2.Usage(prompt_tokens=16, completion_tokens=ids[-1] + 1),
        )
        if public:
            msg.text = " tok" * len(ids)
        out.append(msg)
    return out


class _Steps:
    """An engine's cadence (`--step-ms`): every handler writes its next message when the
    next step comes, all of them at once, as the relay writes after each engine batch."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self._next: asyncio.Future[None] | None = None
        self._ticker: asyncio.Task[None] | None = None

    async def wait(self) -> None:
        if self.step_s <= 0:
            return
        if self._ticker is None:
            self._ticker = asyncio.ensure_future(self._tick())
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        await self._next

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            step, self._next = self._next, None
            if step is not None:
                step.set_result(None)


class _Writer(generation_pb2_grpc.TextGenerationServiceServicer):
    def __init__(self, num_tokens: int, public: bool, steps: _Steps) -> None:
        self.num_tokens = num_tokens
        self.public = public
        self.steps = steps

    async def Generate(self, request, context):
        k = max(1, request.sampling_params.max_tokens)  # tokens per message
        for msg in _messages(request.request_id, self.num_tokens, k, self.public):
            await self.steps.wait()
            await context.write(msg)


class _EngineWriter(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, writer: _Writer) -> None:
        self.writer = writer

    async def Generate(self, request, context):
        k = max(1, request.sampling_params.max_tokens)
        for msg in _messages(request.request_id, self.writer.num_tokens, k, False):
            await self.writer.steps.wait()
            await context.write(msg)


async def _serve(port: int, num_tokens: int, public: bool, step_s: float) -> None:
    server = grpc.aio.server()
    writer = _Writer(num_tokens, public, _Steps(step_s))
    generation_pb2_grpc.add_TextGenerationServiceServicer_to_server(writer, server)
    engine_pb2_grpc.add_EngineServiceServicer_to_server(_EngineWriter(writer), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _read_all(address: str, num_streams: int, k: int, public: bool) -> int:
    """Messages received over `num_streams` concurrent calls."""
    async with grpc.aio.insecure_channel(address) as channel:
        params = common_pb2.SamplingParams(max_tokens=k)
        if public:
            stub = generation_pb2_grpc.TextGenerationServiceStub(channel)
            make = generation_pb2.GenerateRequest
        else:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            make = engine_pb2.EngineGenerateRequest

        async def one(i: int) -> int:
            request = make(request_id=str(i), sampling_params=params)
            return sum([1 async for _ in stub.Generate(request)])

        return sum(await asyncio.gather(*(one(i) for i in range(num_streams))))


def _thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread of `pid`, by thread name (the main thread as "main")."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:
            continue
        name = "main" if task.name == str(pid) else stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return out


def _one_run(address: str, pid: int, args: argparse.Namespace, k: int) -> dict[str, float]:
    public = args.message == "public"
    threads = _thread_cpu_s(pid)
    server_cpu, client_cpu = process_cpu_s(pid), time.process_time()
    start = time.perf_counter()
    num = asyncio.run(_read_all(address, args.streams, k, public))
    wall = time.perf_counter() - start
    server = process_cpu_s(pid) - server_cpu
    num_tokens = args.streams * args.tokens
    after = _thread_cpu_s(pid)
    main = after.get("main", 0.0) - threads.get("main", 0.0)
    return {
        "messages_per_s": num / wall,
        "server_cpu_us_per_message": 1e6 * server / num,
        "server_cpu_us_per_token": 1e6 * server / num_tokens,
        "server_loop_thread_share": main / server if server else 0.0,
        "client_cpu_us_per_message": 1e6 * (time.process_time() - client_cpu) / num,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per call (256)")
    parser.add_argument("--tokens-per-message", default="1,8,16", help="k values (1,8,16)")
    parser.add_argument("--message", choices=("public", "engine"), default="public")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="write at an engine's cadence: one message per call every STEP_MS (0: at once)",
    )
    parser.add_argument("--serve-port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    public = args.message == "public"
    if args.serve_port is not None:  # the server process
        asyncio.run(_serve(args.serve_port, args.tokens, public, args.step_ms / 1000))
        return 0
    ks = [int(k) for k in args.tokens_per_message.split(",")]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [sys.executable, __file__, "--serve-port", str(port), "--tokens", str(args.tokens)]
    argv += ["--message", args.message, "--step-ms", str(args.step_ms)]
    server = subprocess.Popen(argv)
    address = f"127.0.0.1:{port}"
    runs: dict[int, list[dict[str, float]]] = {k: [] for k in ks}
    try:
        deadline = time.monotonic() + 120
        while True:  # warm-up, and: the server is up
            try:
                asyncio.run(_read_all(address, 2, 1, public))
                break
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.5)
        for _ in range(args.repeats):
            for k in ks:  # alternating: a change of load hits every k alike
                runs[k].append(_one_run(address, server.pid, args, k))
                print(f"k={k}", {n: round(v, 2) for n, v in runs[k][-1].items()}, flush=True)
    finally:
        server.terminate()
        server.wait(30)
    for k in ks:
        for key in runs[k][0]:
            values = [r[key] for r in runs[k]]
            spread = max(values) - min(values)
            print(f"k={k} {key}: median {statistics.median(values):.2f}, spread {spread:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
