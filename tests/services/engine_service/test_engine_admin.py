"""The engine service's operator RPCs over a real loopback server: StartProfile /
StopProfile (a Chrome trace with the model's forward, FAILED_PRECONDITION naming the
variable when profiling is not configured) and Sleep / WakeUp / IsSleeping (requests wait,
Health on both APIs says the engine sleeps)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from engine.worker.profiler import PROFILER_DIR_ENV
from pagedserve.v1 import common_pb2, engine_pb2


def generate(stack, request_id: str, max_tokens: int = 3) -> list[int]:
    request = engine_pb2.EngineGenerateRequest(
        request_id=request_id,
        prompt_token_ids=[5, 6, 7, 8],
        sampling_params=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True
        ),
    )
    return [t for r in stack.engine_stub.Generate(request, timeout=60) for t in r.token_ids]


def test_profile_rpcs(stack, tmp_path, monkeypatch):
    monkeypatch.delenv(PROFILER_DIR_ENV, raising=False)
    with pytest.raises(grpc.RpcError) as info:
        stack.engine_stub.StartProfile(engine_pb2.StartProfileRequest(), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert PROFILER_DIR_ENV in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stack.engine_stub.StopProfile(engine_pb2.StopProfileRequest(), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    monkeypatch.setenv(PROFILER_DIR_ENV, str(tmp_path))
    stack.engine_stub.StartProfile(engine_pb2.StartProfileRequest(), timeout=30)
    assert len(generate(stack, "profiled")) == 3
    reply = stack.engine_stub.StopProfile(engine_pb2.StopProfileRequest(), timeout=60)
    assert len(reply.trace_paths) == 1
    path = Path(reply.trace_paths[0])
    assert path.parent == tmp_path
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e.get("name") == "LlamaForCausalLM.forward" for e in events)
    assert len(generate(stack, "after")) == 3  # the engine serves on
    stack.wait_until_idle()


def test_sleep_rpcs_and_health(stack):
    """Sleep → requests wait, health stays SERVING and says the engine sleeps → WakeUp →
    the waiting request completes with the tokens an awake engine gives."""
    stub = stack.engine_stub
    reference = generate(stack, "before-sleep", max_tokens=4)
    stack.wait_until_idle()
    with pytest.raises(grpc.RpcError) as info:
        stub.Sleep(engine_pb2.SleepRequest(level=3), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "level" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.WakeUp(engine_pb2.WakeUpRequest(tags=["kv_cache", "cache"]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tags[1]" in info.value.details()

    stub.Sleep(engine_pb2.SleepRequest(level=1), timeout=60)
    try:
        assert stub.IsSleeping(engine_pb2.IsSleepingRequest(), timeout=30).is_sleeping
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(generate, stack, "sent-asleep", 4)
            wait_for(lambda: stack.stats().num_waiting == 1)  # arrived, and held waiting
            assert not waiting.done()
            engine_health = stub.Health(common_pb2.HealthRequest(), timeout=30)
            assert engine_health.healthy and engine_health.details["is_sleeping"] == "true"
            public = stack.public.Health(common_pb2.HealthRequest(), timeout=30)
            assert public.healthy and public.details["engine.is_sleeping"] == "true"
            with pytest.raises(grpc.RpcError) as info:  # not idle: one request waits
                stub.Sleep(engine_pb2.SleepRequest(level=2), timeout=30)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            stub.WakeUp(engine_pb2.WakeUpRequest(), timeout=60)
            assert waiting.result(timeout=60) == reference
    finally:
        stub.WakeUp(engine_pb2.WakeUpRequest(), timeout=60)
    assert not stub.IsSleeping(engine_pb2.IsSleepingRequest(), timeout=30).is_sleeping
    health = stub.Health(common_pb2.HealthRequest(), timeout=30)
    assert health.details["is_sleeping"] == "false"
    stack.wait_until_idle()


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
