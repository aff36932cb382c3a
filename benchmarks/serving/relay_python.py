"""The tokenizer service's own Python per relayed token, without gRPC: what
`benchmarks/serving/tier_cost.py` measures minus the two hops' `grpc.aio` machinery.

    python benchmarks/serving/relay_python.py [--streams 64] [--tokens 256]
        [--stream-interval 1,16] [--repeats 5]

The relay's real parts in one process: an `EngineStreamMux` whose GenerateStream call is a
stand-in that yields serialized `EngineStreamBatch`es (one per engine step, an entry per
stream, as the engine service sends them: parsed here as gRPC's deserializer would), one
`EngineRelay._relay` per stream with its `MergingReader` and `TextStream` (the default
model's tokenizer, the Rust detokenizer), and a client write that only counts. Each step's
batch is handed over, then the loop runs until the relays have taken it. The text is English
words with a few multi-byte characters.

Per stream interval it prints the process CPU time per output token (median, min, max over
the repeats) and client messages per token. The difference to tier_cost.py's tokenizer
figure is the gRPC side: the client write, the batches' receipt and the event loop's
wake-ups for them.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

_TEXT = "The quick brown fox jumps over the lazy dog, 日本 🙂 and é. " * 40


def _batches(token_ids: list[int], num_streams: int, num_tokens: int) -> list[bytes]:
    """One serialized batch per step: each stream's next token and running usage; the last
    step's entries finish (LENGTH) and end (OK)."""
    from pagedserve.v1 import common_pb2, engine_pb2

    out = []
    for step in range(num_tokens):
        batch = engine_pb2.EngineStreamBatch()
        for stream in range(num_streams):
            response = batch.outputs.add(stream_id=stream + 1).response
            response.request_id = f"req-{stream}"
            response.token_ids.append(token_ids[(step * 7 + stream) % len(token_ids)])
            response.usage.prompt_tokens = 16
            response.usage.completion_tokens = step + 1
            if step == num_tokens - 1:
                response.finish_reason = common_pb2.FINISH_REASON_LENGTH
        if step == num_tokens - 1:
            for stream in range(num_streams):
                batch.outputs.add(stream_id=stream + 1).end.code = 0
        out.append(batch.SerializeToString())
    return out


class _StandInCall:
    """The GenerateStream call: yields the batches put into its queue."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def initial_metadata(self) -> tuple:
        return ()

    def done(self) -> bool:
        return False

    def cancel(self) -> None:
        pass

    def __aiter__(self) -> _StandInCall:
        return self

    async def __anext__(self):
        from pagedserve.v1 import engine_pb2

        raw = await self.queue.get()
        if raw is None:
            raise StopAsyncIteration
        return engine_pb2.EngineStreamBatch.FromString(raw)


class _Stub:
    def __init__(self) -> None:
        self.call = _StandInCall()

    def GenerateStream(self, requests, metadata=None):
        return self.call


class _Replica:
    def __init__(self) -> None:
        from services.tokenizer_service.replicas.migration import StreamWatch

        self.watch = StreamWatch()
        self.num_inflight = self.num_pending = 0


class _Client:
    """The client's side of a Generate call: a write that only counts."""

    def __init__(self) -> None:
        self.num_messages = self.num_tokens = 0

    async def write(self, response) -> None:
        self.num_messages += 1
        self.num_tokens += len(response.token_ids)

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return False


async def _burst(
    tokenizer: Any, raw_batches: list[bytes], num_streams: int, interval: int
) -> tuple[float, int, int]:
    from pagedserve.v1 import common_pb2, engine_pb2
    from services.common.metrics import TokenizerMetrics
    from services.tokenizer_service.replicas.migration import HeldStream
    from services.tokenizer_service.replicas.pool import TrackedCall
    from services.tokenizer_service.replicas.relay import EngineRelay, LiveRequest
    from services.tokenizer_service.replicas.stream_mux import EngineStreamMux
    from services.tokenizer_service.sampling import RequestSampling
    from services.tokenizer_service.text_stream import TextStream, TokenTexts

    stub = _Stub()
    mux = EngineStreamMux(stub, "stand-in")
    assert await mux.available()
    relay = EngineRelay(None, TokenizerMetrics(lambda: 0), stream_interval=interval)
    texts = TokenTexts(tokenizer)
    params = RequestSampling(common_pb2.SamplingParams(max_tokens=len(raw_batches)), {})
    clients, relays = [], []
    for stream in range(num_streams):
        request_id = f"req-{stream}"
        call = mux.generate(engine_pb2.EngineGenerateRequest(request_id=request_id), None)
        replica = _Replica()
        text_stream = TextStream(request_id, tokenizer, [1, 2, 3], params, texts)
        client = _Client()
        clients.append(client)
        relays.append(
            asyncio.ensure_future(
                relay._relay(
                    call,
                    replica,
                    TrackedCall(replica),
                    HeldStream(),
                    LiveRequest(),
                    text_stream,
                    client,
                )
            )
        )
    await asyncio.sleep(0)
    cpu = time.process_time()
    for raw in raw_batches:
        stub.call.queue.put_nowait(raw)
        for _ in range(3):  # the mux reads the batch, the relays run, they write
            await asyncio.sleep(0)
    await asyncio.gather(*relays)
    cpu = time.process_time() - cpu
    num_tokens = sum(c.num_tokens for c in clients)
    assert num_tokens == num_streams * len(raw_batches), num_tokens
    return cpu, num_tokens, sum(c.num_messages for c in clients)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per stream (256)")
    parser.add_argument("--stream-interval", default="1,16", help="N values (1,16)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from services.tokenizer_service.light_tokenizer import load_light_tokenizer
    from tests.model_utils import _copy_tokenizer

    with tempfile.TemporaryDirectory(prefix="relay-python-") as directory:
        _copy_tokenizer(None, Path(directory))
        tokenizer = load_light_tokenizer(Path(directory))
    token_ids = tokenizer.backend_tokenizer.encode(_TEXT, add_special_tokens=False).ids
    raw_batches = _batches(token_ids, args.streams, args.tokens)
    for interval in (int(n) for n in args.stream_interval.split(",")):
        us = []
        for _ in range(args.repeats):
            cpu, num_tokens, num_messages = asyncio.run(
                _burst(tokenizer, raw_batches, args.streams, interval)
            )
            us.append(1e6 * cpu / num_tokens)
        print(
            f"stream_interval {interval}: relay CPU-us per token median "
            f"{statistics.median(us):.2f} (min {min(us):.2f}, max {max(us):.2f}), "
            f"client messages per token {num_messages / num_tokens:.3f}"
        )


if __name__ == "__main__":
    main()
