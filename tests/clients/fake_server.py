"""A fake public API for the client tests: it fails on cue (UNAVAILABLE for the first calls,
or after the first streamed message) and can listen with TLS."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc

from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

TOKENS = [7, 8, 9]


class FakeService(generation_pb2_grpc.TextGenerationServiceServicer):
    """Generate streams TOKENS, one per message, as "t7", "t8", "t9". The first
    `num_unavailable` calls (of any method) fail with UNAVAILABLE; with `fail_after_first`,
    Generate fails with UNAVAILABLE right after its first message."""

    def __init__(self, num_unavailable: int = 0, fail_after_first: bool = False) -> None:
        self.num_unavailable = num_unavailable
        self.fail_after_first = fail_after_first
        self.num_calls = 0
        self.requests: list[generation_pb2.GenerateRequest] = []  # Generate's, in order
        self._lock = threading.Lock()

    def _count_call(self, context: grpc.ServicerContext) -> None:
        with self._lock:
            self.num_calls += 1
            fail = self.num_calls <= self.num_unavailable
        if fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still loading")

    def Generate(self, request, context):
        self.requests.append(request)
        self._count_call(context)
        for i, token_id in enumerate(TOKENS):
            last = i == len(TOKENS) - 1
            yield generation_pb2.GenerateResponse(
                request_id=request.request_id or "fake-1",
                text=f"t{token_id}",
                token_ids=[token_id],
                usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=i + 1),
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
            )
            if self.fail_after_first:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the engine died")

    def Tokenize(self, request, context):
        self._count_call(context)
        return generation_pb2.TokenizeResponse(token_ids=[1, 2], tokens=["a", "b"], count=2)

    def Health(self, request, context):
        self._count_call(context)
        return common_pb2.HealthResponse(healthy=True, status="SERVING")


def start_fake_server(
    service: FakeService, port: int = 0, credentials: grpc.ServerCredentials | None = None
) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    generation_pb2_grpc.add_TextGenerationServiceServicer_to_server(service, server)
    address = f"127.0.0.1:{port}"
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    server.start()
    return server, port
