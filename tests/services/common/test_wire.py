"""Malformed request bytes on every RPC of both services: INVALID_ARGUMENT naming the
method, at most one (rate-limited) warning line and no ERROR traceback; and a client's
deadline travels to the engine, which aborts the request and frees its blocks."""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from pagedserve.v1 import common_pb2, engine_pb2
from services.common.wire import RateLimitedWarning
from tests.services.helpers import gather, request
from tests.services.raw import (
    ENGINE_METHODS,
    HEALTH_CHECK,
    PUBLIC_METHODS,
    call_raw_details,
)

# Not a message: a field tag with wire type 7 (there is none); a string field (1) whose
# bytes are not UTF-8; a length that runs past the end.
MALFORMED = {
    "bad wire type": b"\x0f\x01",
    "string not utf-8": b"\x0a\x02\xff\xfe",
    "truncated": b"\x0a\x10abc",
}


def _parses(message_type: type, payload: bytes) -> bool:
    try:
        message_type.FromString(payload)
    except Exception:
        return False
    return True


def test_each_payload_is_malformed_for_the_generate_requests():
    for payload in MALFORMED.values():
        for method in (PUBLIC_METHODS[0], ENGINE_METHODS[0]):
            assert method.name == "Generate" and not _parses(method.request_type, payload)


@pytest.mark.parametrize("payload", MALFORMED.values(), ids=list(MALFORMED))
def test_malformed_bytes_are_invalid_argument_on_every_rpc(stack, payload, caplog):
    targets = [(stack.public_channel, m) for m in [*PUBLIC_METHODS, HEALTH_CHECK]]
    targets += [(stack.engine_channel, m) for m in [*ENGINE_METHODS, HEALTH_CHECK]]
    with caplog.at_level(logging.DEBUG):
        for _ in range(3):  # a flood, the same bytes over and over
            for channel, method in targets:
                if _parses(method.request_type, payload):
                    continue  # e.g. an empty message skips what it does not know
                code, details = call_raw_details(channel, method, payload, timeout=10)
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (method.path, code, details)
                assert method.path in details and "do not parse" in details
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "an ERROR was logged"
    warnings = [r for r in caplog.records if r.name == "services.common.wire"]
    assert len(warnings) <= 2  # one per server at most, however many calls
    # Others are not disturbed.
    out = gather(stack.public.Generate(request(token_ids=[5, 6, 7], max_tokens=3), timeout=30))
    assert len(out[0].token_ids) == 3
    stack.wait_until_idle()


def test_the_warning_is_rate_limited(caplog):
    warning = RateLimitedWarning(interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="services.common.wire"):
        logged = [warning.warn("malformed request bytes rejected", method="/x") for _ in range(50)]
    assert logged == [True] + [False] * 49 and warning.num_total == 50
    assert len(caplog.records) == 1


def test_the_client_deadline_reaches_the_engine_which_frees_the_blocks(stack):
    long_request = engine_pb2.EngineGenerateRequest(
        request_id="deadline-at-engine",
        prompt_token_ids=[5, 6, 7],
        sampling_params=common_pb2.SamplingParams(max_tokens=4000, ignore_eos=True),
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stack.engine_stub.Generate(long_request, timeout=0.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stack.wait_until_idle()  # aborted at the engine, every block free
    # Through the public API: the tokenizer passes what is left of the deadline on.
    long_public = request(token_ids=[5, 6, 7], max_tokens=4000, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as info:
        gather(stack.public.Generate(long_public, timeout=0.7))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stack.wait_until_idle()


def test_malformed_bytes_in_a_request_stream_reflection(stack, caplog):
    path = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    with caplog.at_level(logging.DEBUG):
        for channel in (stack.public_channel, stack.engine_channel):
            call = channel.stream_stream(path)(iter([b"\x0f\x01"]), timeout=10)
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert path in info.value.details()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "an ERROR was logged"
    # A well-formed stream still works.
    ask = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    (reply,) = stack.public_channel.stream_stream(path)(iter([ask]), timeout=10)
    listed = reflection_pb2.ServerReflectionResponse.FromString(reply)
    assert "pagedserve.v1.TextGenerationService" in {
        s.name for s in listed.list_services_response.service
    }
