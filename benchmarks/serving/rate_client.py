"""One client process of `tier_at_rate.py`: streams its share of the requests through the
public API (`TextGenerationService.Generate`) of a running tokenizer service, all at once,
and reports what came back.

    python benchmarks/serving/rate_client.py --address 127.0.0.1:50051 --prompts-file p.json \
        --first 0 --count 128 --output-len 256

It connects, prints `ready`, waits for a line on stdin (so that every client process starts
its burst together, outside the measured start-up), streams, then prints one JSON line:
tokens, messages, its own CPU seconds over the burst (`process_time`), every stream's gaps
between consecutive messages (seconds), the streams whose end was wrong (a finish reason
other than length, a usage that does not count `output-len` tokens), and with `--texts`
every stream's text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402


async def _stream(
    stub: generation_pb2_grpc.TextGenerationServiceStub,
    prompt: list[int],
    output_len: int,
    gaps: list[float],
) -> tuple[int, int, str, bool]:
    """(tokens, messages, text, ended right) of one request."""
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=output_len)
    request = generation_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=prompt), sampling_params=params
    )
    num_tokens = num_messages = 0
    pieces: list[str] = []
    last_time = None
    last = None
    async for response in stub.Generate(request):
        now = time.perf_counter()
        if last_time is not None:
            gaps.append(now - last_time)
        last_time, last = now, response
        num_tokens += len(response.token_ids)
        num_messages += 1
        pieces.append(response.text)
    ended_right = (
        last is not None
        and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        and last.usage.completion_tokens == output_len
        and num_tokens == output_len
    )
    return num_tokens, num_messages, "".join(pieces), ended_right


async def run(args: argparse.Namespace) -> dict:
    prompts = json.loads(args.prompts_file.read_text())[args.first : args.first + args.count]
    channels = [grpc.aio.insecure_channel(args.address) for _ in range(args.channels)]
    for channel in channels:
        await asyncio.wait_for(channel.channel_ready(), 60)
    stubs = [generation_pb2_grpc.TextGenerationServiceStub(c) for c in channels]
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    gaps: list[float] = []
    cpu = time.process_time()
    start = time.perf_counter()
    results = await asyncio.gather(
        *(
            _stream(stubs[i % len(stubs)], prompt, args.output_len, gaps)
            for i, prompt in enumerate(prompts)
        )
    )
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu
    for channel in channels:
        await channel.close()
    report = {
        "tokens": sum(r[0] for r in results),
        "messages": sum(r[1] for r in results),
        "cpu_s": cpu,
        "wall_s": wall,
        "gaps": [round(g, 6) for g in gaps],
        "wrong_ends": [args.first + i for i, r in enumerate(results) if not r[3]],
    }
    if args.texts:
        report["texts"] = [r[2] for r in results]
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--prompts-file", type=Path, required=True)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--channels", type=int, default=1, help="connections (1)")
    parser.add_argument("--texts", action="store_true", help="report every stream's text")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
