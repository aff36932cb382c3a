"""What one streamed gRPC message costs in Python's `grpc.aio`, with nothing else in the way:
the floor under each hop of the serving tier (benchmarks/serving/tier_cost.py).

    python benchmarks/serving/grpc_stream_floor.py [--streams 64] [--messages 256] [--repeats 3]

A server process whose Generate handler only writes `--messages` engine-shaped messages (one
token id and a usage each), and a client in this process that reads `--streams` such calls at
once. Prints, per run, messages/s and the CPU microseconds per message of the server
(/proc/<pid>/stat) and of the client (`process_time`); then the medians and spreads. A hop
that sends one message per token costs at least this much per token on each side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

from pagedserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc  # noqa: E402

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class _Writer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, num_messages: int) -> None:
        self.num_messages = num_messages

    async def Generate(self, request, context):
        for i in range(self.num_messages):
            await context.write(
                engine_pb2.EngineGenerateResponse(
                    request_id=request.request_id,
                    token_ids=[i],
                    usage=common_pb2.Usage(prompt_tokens=16, completion_tokens=i + 1),
                )
            )


async def _serve(port: int, num_messages: int) -> None:
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(_Writer(num_messages), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _read_all(address: str, num_streams: int) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)

        async def one(i: int) -> int:
            request = engine_pb2.EngineGenerateRequest(request_id=str(i))
            return sum([1 async for _ in stub.Generate(request)])

        return sum(await asyncio.gather(*(one(i) for i in range(num_streams))))


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--messages", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve-port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_port is not None:  # the server process
        asyncio.run(_serve(args.serve_port, args.messages))
        return 0
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [sys.executable, __file__, "--serve-port", str(port), "--messages", str(args.messages)]
    server = subprocess.Popen(argv)
    address = f"127.0.0.1:{port}"
    runs = []
    try:
        time.sleep(1.0)
        asyncio.run(_read_all(address, 2))  # warm-up (and: the server is up)
        for _ in range(args.repeats):
            server_cpu, client_cpu = _cpu_s(server.pid), time.process_time()
            start = time.perf_counter()
            num = asyncio.run(_read_all(address, args.streams))
            wall = time.perf_counter() - start
            runs.append(
                {
                    "messages_per_s": num / wall,
                    "server_cpu_us_per_message": 1e6 * (_cpu_s(server.pid) - server_cpu) / num,
                    "client_cpu_us_per_message": 1e6 * (time.process_time() - client_cpu) / num,
                }
            )
            print({k: round(v, 1) for k, v in runs[-1].items()}, flush=True)
    finally:
        server.terminate()
        server.wait(30)
    for key in runs[0]:
        values = [r[key] for r in runs]
        spread = max(values) - min(values)
        print(f"{key}: median {statistics.median(values):.1f}, spread {spread:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
