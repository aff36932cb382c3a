"""Raw calls: bytes in, a status out, to any method of either service (identity
serializers, so nothing on the client side checks what is sent)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from pagedserve.v1 import engine_pb2, generation_pb2


@dataclass(frozen=True)
class Method:
    path: str  # /package.Service/Method
    server_streaming: bool
    request_type: type

    @property
    def name(self) -> str:
        return self.path.rpartition("/")[2]


def _methods(file_descriptor, service: str, module) -> list[Method]:
    descriptor = file_descriptor.services_by_name[service]
    return [
        Method(
            f"/{descriptor.full_name}/{m.name}",
            m.server_streaming,
            _message_class(m.input_type),
        )
        for m in descriptor.methods
    ]


def _message_class(descriptor) -> type:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


PUBLIC_METHODS = _methods(generation_pb2.DESCRIPTOR, "TextGenerationService", generation_pb2)
ENGINE_METHODS = _methods(engine_pb2.DESCRIPTOR, "EngineService", engine_pb2)
HEALTH_CHECK = Method("/grpc.health.v1.Health/Check", False, health_pb2.HealthCheckRequest)


def call_raw(
    channel: grpc.Channel,
    method: Method,
    payload: bytes,
    timeout: float,
    metadata: list[tuple[str, str]] | None = None,
    responses: list[bytes] | None = None,
) -> grpc.StatusCode:
    """Sends `payload` as the request (on a request stream: its only message); the call's
    final status (a stream is drained, into `responses` if given)."""
    try:
        if method.server_streaming:
            call = channel.unary_stream(method.path)(payload, timeout=timeout, metadata=metadata)
            for response in call:
                if responses is not None:
                    responses.append(response)
        else:
            channel.unary_unary(method.path)(payload, timeout=timeout, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def call_raw_details(
    channel: grpc.Channel, method: Method, payload: bytes, timeout: float
) -> tuple[grpc.StatusCode, str]:
    try:
        if method.server_streaming:
            for _ in channel.unary_stream(method.path)(payload, timeout=timeout):
                pass
        else:
            channel.unary_unary(method.path)(payload, timeout=timeout)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""
