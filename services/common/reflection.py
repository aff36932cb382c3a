"""Server reflection under both names clients ask for: `grpc.reflection.v1` (what current
grpcurl, Postman and gateways try first) and `grpc.reflection.v1alpha` (older clients).

grpcio-reflection implements v1alpha only. The two protocols differ in the package name
alone (same messages, same field numbers, so the same bytes on the wire), so v1 is served by
the v1alpha servicer behind a generic handler, and a renamed copy of the v1alpha file
descriptor is added to the descriptor pool so that v1 itself can be described.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1ALPHA_SERVICE = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
_V1ALPHA_PACKAGE = v1alpha_pb2.DESCRIPTOR.package
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _register_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Adds `grpc/reflection/v1/reflection.proto` (the v1alpha file, renamed) to `pool`."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = _V1_FILE, V1_PACKAGE
    old, new = f".{_V1ALPHA_PACKAGE}.", f".{V1_PACKAGE}."
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name[len(old) :]
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old) :]
            method.output_type = new + method.output_type[len(old) :]
    # A v1 file of another origin may have got there first: describing v1 then uses it.
    with contextlib.suppress(TypeError):
        pool.Add(proto)


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Reflection (v1 and v1alpha) listing `service_names`, health and reflection itself."""
    names = (*service_names, health.SERVICE_NAME, V1_SERVICE, V1ALPHA_SERVICE)
    _register_v1_descriptor(descriptor_pool.Default())
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.method_handlers_generic_handler(
        V1_SERVICE,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
                response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
