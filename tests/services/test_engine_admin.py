"""The engine service's operator RPCs over a real loopback server: StartProfile /
StopProfile (a Chrome trace with the model's forward, FAILED_PRECONDITION naming the
variable when profiling is not configured)."""

from __future__ import annotations

import json
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
