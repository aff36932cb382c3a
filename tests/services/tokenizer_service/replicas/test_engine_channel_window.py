"""The channel to an engine replica keeps gRPC's initial receive window (no BDP probing,
replicas/engine_client.py `open_engine_channel`): an engine stream read slowly (a relay
behind its engine) can run only a bounded number of bytes ahead of the reader, so what is
left waits on the engine's side, where the next batch takes it all in, rather than in this
side's buffers one engine step per message."""

from __future__ import annotations

import asyncio
import time

import grpc

from pagedserve.v1 import engine_pb2, engine_pb2_grpc
from services.tokenizer_service.replicas.engine_client import open_engine_channel

_ENTRIES = 64
_READ_FOR_S = 0.6
# gRPC's initial window is 64 KiB; probing grows it to megabytes (2.5 MB here in 1 s).
_MAX_BYTES_AHEAD = 256 * 1024


def _step_batch() -> engine_pb2.EngineStreamBatch:
    """One engine step of 64 streams, one token each (~640 bytes)."""
    batch = engine_pb2.EngineStreamBatch()
    for stream_id in range(_ENTRIES):
        batch.outputs.add(stream_id=stream_id, response={"index": 0, "token_ids": [1000]})
    return batch


class _FastEngine(engine_pb2_grpc.EngineServiceServicer):
    """Writes step batches as fast as flow control lets it; counts what it wrote."""

    def __init__(self) -> None:
        self.num_written = 0

    async def GenerateStream(self, request_iterator, context) -> None:
        batch = _step_batch()
        while True:
            await context.write(batch)
            self.num_written += 1


def test_a_slow_reader_holds_the_engine_back_within_the_initial_window() -> None:
    async def run() -> tuple[int, int]:
        engine = _FastEngine()
        server = grpc.aio.server()
        engine_pb2_grpc.add_EngineServiceServicer_to_server(engine, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = open_engine_channel(f"127.0.0.1:{port}")
        try:
            call = engine_pb2_grpc.EngineServiceStub(channel).GenerateStream(iter(()))
            num_read = 0
            start = time.monotonic()
            while time.monotonic() - start < _READ_FOR_S:  # a reader behind: 1 per 2 ms
                await call.read()
                num_read += 1
                await asyncio.sleep(0.002)
            call.cancel()
            return num_read, engine.num_written
        finally:
            await channel.close()
            await server.stop(0)

    num_read, num_written = asyncio.run(run())
    assert num_read > 10
    bytes_ahead = (num_written - num_read) * _step_batch().ByteSize()
    assert 0 < bytes_ahead <= _MAX_BYTES_AHEAD, (num_read, num_written)
