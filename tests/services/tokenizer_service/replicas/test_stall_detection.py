"""When the tokenizer service gives a replica's streams up as stalled (replicas/engine_client.py).

Silence on every stream a replica holds is a stall only while the replica does not answer
its health check either: a live replica busy prefilling streams moved to it can be silent for
longer than the timeout, and giving its streams up then loses them when no replica is left.
The replica here is a real gRPC server on a real socket that answers health and keeps the
stream silent; stopping it is what a SIGSTOP or a partition looks like to the client.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.grpc_server import ENGINE_SERVICE
from services.common.migration import REASON_STALLED
from services.tokenizer_service.replicas.engine_client import EngineBackend

STALL_TIMEOUT_S = 0.2
WAIT_S = 120.0  # a generous deadline for each condition (a loaded machine)


class CountingHealth(health.aio.HealthServicer):
    """The standard health servicer, counting the checks it answers."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    async def Check(self, request, context):
        self.checks += 1
        return await super().Check(request, context)


async def _wait_until(condition, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _scenario() -> None:
    servicer = CountingHealth()
    await servicer.set(ENGINE_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    async def on_health_change(available: bool, reason: str) -> None:
        return None

    replica = EngineBackend(
        f"127.0.0.1:{port}",
        on_health_change,
        poll_interval_s=0.02,
        stall_timeout_s=STALL_TIMEOUT_S,
    )
    replica.start()
    try:
        with replica.watch.hold() as held:
            # Silent far past the timeout, while it answers its health check: kept.
            await _wait_until(lambda: replica.watch.silent_s() > 3 * STALL_TIMEOUT_S, "silence")
            seen = servicer.checks
            await _wait_until(lambda: servicer.checks >= seen + 3, "three more health checks")
            assert replica.watch.silent_s() > STALL_TIMEOUT_S
            assert held.lost is None, "a replica that answers health was given up as stalled"

            # The same silence once it no longer answers (stopped, partitioned): a stall.
            await server.stop(None)
            await _wait_until(lambda: held.lost is not None, "the stream to be given up")
            assert held.lost == REASON_STALLED
    finally:
        await replica.close()
        await server.stop(None)


def test_silence_is_a_stall_only_when_health_goes_unanswered():
    asyncio.run(_scenario())
