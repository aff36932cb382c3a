"""Standard health checks, reflection, and the engine service going away and coming back."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from pagedserve.v1 import common_pb2
from services.common.grpc_server import ENGINE_SERVICE, TEXT_GENERATION_SERVICE
from services.engine_service.vllm_servicer import VLLM_ENGINE_SERVICE
from tests.services.helpers import gather, request, wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _check(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_standard_health_checks(stack):
    for channel, service in (
        (stack.public_channel, TEXT_GENERATION_SERVICE),
        (stack.engine_channel, ENGINE_SERVICE),
    ):
        assert _check(channel) == SERVING
        assert _check(channel, service) == SERVING
        with pytest.raises(grpc.RpcError) as info:
            _check(channel, "no.such.Service")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert _check(stack.engine_channel, VLLM_ENGINE_SERVICE) == SERVING  # both engine APIs
    reply = stack.public.Health(common_pb2.HealthRequest())
    assert reply.healthy and reply.status == "SERVING"
    assert reply.details["engine_reachable"] == "true"
    (replica,) = [v for k, v in reply.details.items() if k.startswith("replica.")]
    assert replica.startswith("up waiting=")


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_the_services(stack, version):
    """Both reflection protocols answer (current grpcurl asks v1 first). The messages are the
    same in both, so v1 is called here with the v1alpha classes on v1's method path."""
    for channel, services in (
        (stack.public_channel, {TEXT_GENERATION_SERVICE}),
        (stack.engine_channel, {ENGINE_SERVICE, VLLM_ENGINE_SERVICE}),
    ):
        call = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        service = sorted(services)[0]
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=service),
            reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="grpc.reflection.v1.ServerReflection"
            ),
        ]
        listed, described, v1 = list(call(iter(requests), timeout=5))
        names = {s.name for s in listed.list_services_response.service}
        assert names == {
            *services,
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        }
        assert described.file_descriptor_response.file_descriptor_proto  # grpcurl can describe it
        assert v1.file_descriptor_response.file_descriptor_proto, v1.error_response


def test_engine_down_then_back(stack):
    long_req = request(token_ids=[7, 8, 9], max_tokens=2000, ignore_eos=True)
    stream = stack.public.Generate(long_req, timeout=60)
    next(stream)
    threading.Thread(target=stack.stop_engine_server, daemon=True).start()
    with pytest.raises(grpc.RpcError) as info:
        list(stream)  # 2000 tokens: cut long before they are all decoded
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    try:
        wait_for(lambda: stack.engine_server is None)
        wait_for(lambda: _check(stack.public_channel) == NOT_SERVING, timeout=60)
        assert _check(stack.public_channel, TEXT_GENERATION_SERVICE) == NOT_SERVING
        assert not stack.public.Health(common_pb2.HealthRequest()).healthy
        with pytest.raises(grpc.RpcError) as info:
            list(stack.public.Generate(request(token_ids=[1, 2, 3]), timeout=30))
        # At once: a call that waited for the engine would end DEADLINE_EXCEEDED instead.
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        stack.wait_until_idle()  # the cut stream's engine request was aborted
    finally:
        if stack.engine_server is None:
            stack.start_engine_server()
    wait_for(lambda: _check(stack.public_channel) == SERVING, timeout=60)
    outputs = gather(stack.public.Generate(request(token_ids=[1, 2, 3], max_tokens=4)))
    assert len(outputs[0].token_ids) == 4
