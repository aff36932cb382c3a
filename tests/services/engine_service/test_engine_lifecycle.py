"""The engine service's lifecycle as a fleet needs it: a drain (SIGTERM) reports NOT_SERVING
at once and hands unfinished streams back with the migrate status instead of aborting them,
then exits 0; a stuck step turns health NOT_SERVING (and SERVING again when it returns); a
service that cannot start exits non-zero. Real processes and real gRPC servers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import AsyncLLMEngine, EngineArgs, SamplingParams
from engine.front.step_delay import StepDelay
from pagedserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.common.migration import MIGRATE_METADATA_KEY, REASON_DRAINED, migrate_reason
from services.engine_service.server import EngineServer, EngineServerConfig
from tests.services.conftest import ENGINE_KWARGS, LoopThread
from tests.services.helpers import wait_for
from tests.services.processes import ROOT, EngineProcess, child_env, free_port

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LONG = common_pb2.SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)


def _health(channel: grpc.Channel) -> int:
    request = health_pb2.HealthCheckRequest()
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


def test_sigterm_drains_and_hands_streams_back_for_migration(tiny_model_dir) -> None:
    engine = EngineProcess(tiny_model_dir, None, "--shutdown-grace", "3", forked=True).start()
    try:
        engine.wait_serving()
        with grpc.insecure_channel(engine.address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            stream = stub.Generate(
                engine_pb2.EngineGenerateRequest(
                    request_id="long", prompt_token_ids=[5, 6, 7], sampling_params=LONG
                ),
                timeout=120,
            )
            received = list(next(stream).token_ids)
            engine.proc.send_signal(signal.SIGTERM)
            # NOT_SERVING while the stream still runs (its grace has not run out).
            assert wait_for(lambda: _health(channel) == NOT_SERVING, timeout=30)
            with pytest.raises(grpc.RpcError) as refused:
                next(
                    stub.Generate(
                        engine_pb2.EngineGenerateRequest(
                            request_id="new", prompt_token_ids=[5], sampling_params=LONG
                        )
                    )
                )
            assert migrate_reason(refused.value) == REASON_DRAINED  # go elsewhere
            assert _health(channel) == NOT_SERVING  # health keeps answering while draining
            finish_reasons = []
            with pytest.raises(grpc.RpcError) as ended:
                for response in stream:
                    received += response.token_ids
                    finish_reasons.append(response.finish_reason)
        error = ended.value
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert dict(error.trailing_metadata())[MIGRATE_METADATA_KEY] == REASON_DRAINED
        assert migrate_reason(error) == REASON_DRAINED
        assert set(finish_reasons) <= {common_pb2.FINISH_REASON_UNSPECIFIED}
        assert 0 < len(received) < 4000
        assert engine.proc.wait(60) == 0
    finally:
        engine.kill()


def _start_forked(commands: list[list[str]]) -> list[tuple[int, str]]:
    """`python -m services ARGS...` for each ARGS, side by side, each in a child forked from
    one interpreter that has imported torch (tests/forked_starts.py): the start-up paths
    below run as the command runs them, without one torch import each. (returncode,
    stdout and stderr) each."""
    run_main = "import runpy; runpy.run_module('services', run_name='__main__', alter_sys=True)"
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "forked_starts.py")],
        input=json.dumps([["-c", run_main, *args] for args in commands]),
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [(rc, output) for rc, output in json.loads(done.stdout)]


def test_an_engine_service_that_cannot_start_exits_non_zero(tmp_path) -> None:
    args = ["engine", "--log-level", "WARNING"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        bad_model, in_use = _start_forked(
            [
                [
                    *args,
                    "--model",
                    str(tmp_path / "no-such-model"),
                    "--engine-addr",
                    f"127.0.0.1:{free_port()}",
                ],
                [*args, "--engine-addr", f"127.0.0.1:{port}"],
            ]
        )
    assert bad_model[0] != 0
    assert "no-such-model" in bad_model[1]
    assert in_use[0] != 0
    assert f"cannot listen on 127.0.0.1:{port}" in in_use[1]


@pytest.fixture(scope="module")
def in_process(tiny_model_dir) -> Iterator[tuple[LoopThread, AsyncLLMEngine]]:
    """One in-process engine and its event loop for the watchdog tests: each test serves it
    from its own engine service (a fresh watchdog), and each test's request has ended
    before the next begins."""
    loop = LoopThread()
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=str(tiny_model_dir), skip_tokenizer_init=True, **ENGINE_KWARGS)
    )
    yield loop, engine
    engine.shutdown()
    loop.close()


@contextlib.contextmanager
def _watched_engine(in_process, processor, max_tokens: int):
    """An in-process engine service with a 0.5 s stall timeout, and a request whose steps
    run `processor` (a logits processor): yields (server, channel, the request's future,
    resolving to its number of tokens)."""
    loop, engine = in_process

    async def start() -> EngineServer:
        server = EngineServer(EngineServerConfig(address="127.0.0.1:0", engine_stall_timeout_s=0.5))
        await server.start()
        await server.attach_engine(engine)
        return server

    async def generate() -> int:
        params = SamplingParams(max_tokens=max_tokens, logits_processors=[processor])
        outputs = [o async for o in engine.generate({"prompt_token_ids": [5, 6]}, params, "r")]
        return len(outputs[-1].outputs[0].token_ids)

    server = loop.run(start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
            yield server, channel, asyncio.run_coroutine_threadsafe(generate(), loop.loop)
    finally:
        loop.run(server.stop(0))


def test_a_stuck_step_turns_health_not_serving_until_it_returns(in_process) -> None:
    """A logits processor that blocks holds one step without using the CPU; the watchdog
    thread (0.5 s without progress) reports it while the event loop still answers, and
    SERVING comes back once the step returns."""
    release = threading.Event()

    def block(output_ids, logits):
        release.wait(120)
        return logits

    serving = health_pb2.HealthCheckResponse.SERVING
    try:
        with _watched_engine(in_process, block, max_tokens=2) as (_, channel, done):
            assert wait_for(lambda: _health(channel) != serving, timeout=60)
            details = engine_pb2_grpc.EngineServiceStub(channel).Health(
                common_pb2.HealthRequest(), timeout=10
            )
            assert not details.healthy and float(details.details["engine_stalled_s"]) >= 0.5
            release.set()
            assert done.result(120) == 2
            assert wait_for(lambda: _health(channel) == serving, timeout=60)
    finally:
        release.set()


def test_a_slow_busy_step_is_not_a_stall(in_process) -> None:
    """A step that computes for 6 s (a logits processor holding the CPU, as a long prefill
    on a loaded machine does) makes progress: with a 0.5 s stall timeout, health stays
    SERVING throughout and no stall is reported; the request completes."""
    in_step = threading.Event()

    def busy(output_ids, logits):
        in_step.set()
        StepDelay("busy", 6.0).apply()  # the engine's own busy-step hook: 6 s on the CPU
        return logits

    with _watched_engine(in_process, busy, max_tokens=1) as (server, channel, done):
        assert in_step.wait(120)
        statuses = []
        while not done.done():
            statuses.append(_health(channel))
            time.sleep(0.1)
        assert done.result(120) == 1
        assert set(statuses) == {health_pb2.HealthCheckResponse.SERVING}, statuses
        assert not server.watchdog.stalled and server.servicer.stalled_s == 0.0
