"""How rank processes start (engine/executor/start_method.py, rank_forkserver.py): the knob,
and what a rank forked from the preloaded server takes from the driver at its start rather than
from the server (the environment, stdout/stderr), with real processes."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
import uuid

import psutil
import pytest

from engine import EngineArgs, LLMEngine
from engine.executor import rank_forkserver
from engine.executor.mp_executor import RankFailedError
from engine.executor.rank_forkserver import forkserver_context, server_pid
from engine.executor.start_method import (
    WORKER_MULTIPROC_METHOD_ENV,
    default_start_method,
    rank_context,
    worker_multiproc_method,
)
from engine.worker.cpu_kv_budget import CPU_KVCACHE_SPACE_ENV
from tests.engine.executor.child_report import report
from tests.model_utils import make_tiny_llama

forkserver_only = pytest.mark.skipif(
    default_start_method() != "forkserver", reason="this platform has no forkserver"
)


@pytest.fixture
def light_server(monkeypatch) -> None:
    """The server tests need no torch in it: a server of their own (an import-time variable
    and the preload list are its key) that preloads only the module their children unpickle
    first. The next engine's ranks get a fully preloaded one again."""
    monkeypatch.setattr(rank_forkserver, "PRELOAD", ("engine.executor.rank_forkserver",))
    monkeypatch.setenv("PYTHON_PAGEDSERVE_TEST_KEY", uuid.uuid4().hex)


@pytest.mark.parametrize("value", ["fork", "threads", "forkserver,spawn"])
def test_a_bad_start_method_is_refused_naming_the_variable(tmp_path, monkeypatch, value) -> None:
    monkeypatch.setenv(WORKER_MULTIPROC_METHOD_ENV, value)
    with pytest.raises(ValueError, match=WORKER_MULTIPROC_METHOD_ENV):
        worker_multiproc_method()
    path = make_tiny_llama(tmp_path / "m", num_layers=2)
    args = EngineArgs(str(path), skip_tokenizer_init=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=WORKER_MULTIPROC_METHOD_ENV):
        LLMEngine.from_engine_args(args)  # refused before any rank starts


def test_the_start_method_defaults_by_platform_and_takes_either_name(monkeypatch) -> None:
    monkeypatch.delenv(WORKER_MULTIPROC_METHOD_ENV, raising=False)
    expected = "forkserver" if sys.platform == "linux" else "spawn"
    assert worker_multiproc_method() == default_start_method() == expected
    monkeypatch.setenv(WORKER_MULTIPROC_METHOD_ENV, " Spawn ")
    assert worker_multiproc_method() == "spawn"


def _wait_exited(pid: int) -> None:
    """Until `pid`, a child of this process, has exited (not reaped: the code under test
    reaps it)."""
    deadline = time.monotonic() + 60
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"{pid} did not exit"
        time.sleep(0.01)


def _start(ctx, names: list[str], exit_code: int = 0):
    parent_conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=report, args=(child_conn, names, exit_code), daemon=True)
    proc.start()
    child_conn.close()
    return proc, parent_conn


@forkserver_only
def test_a_forked_child_has_the_drivers_environment_and_stderr_of_its_start(
    light_server, monkeypatch
) -> None:
    """The server keeps the environment and fds it started with; the child gets the driver's
    of the moment it is started: set, changed and removed variables, and fd 2."""
    monkeypatch.setenv("PAGEDSERVE_TEST_REMOVED", "at-server-start")
    monkeypatch.setenv("PAGEDSERVE_TEST_CHANGED", "at-server-start")
    before = server_pid()
    forkserver_context()
    started = server_pid()
    assert started is not None and started != before
    monkeypatch.delenv("PAGEDSERVE_TEST_REMOVED")
    monkeypatch.setenv("PAGEDSERVE_TEST_CHANGED", "at-child-start")
    monkeypatch.setenv("PAGEDSERVE_TEST_ADDED", "at-child-start")
    names = ["PAGEDSERVE_TEST_REMOVED", "PAGEDSERVE_TEST_CHANGED", "PAGEDSERVE_TEST_ADDED"]
    ctx = forkserver_context()
    assert server_pid() == started  # no restart: these variables are read later, at init
    with tempfile.TemporaryFile() as stderr:
        saved = os.dup(2)
        os.dup2(stderr.fileno(), 2)
        try:
            proc, conn = _start(ctx, names, exit_code=3)
            seen = conn.recv()
            proc.join(60)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        stderr.seek(0)
        written = stderr.read().decode()
    assert seen == {
        "PAGEDSERVE_TEST_REMOVED": None,
        "PAGEDSERVE_TEST_CHANGED": "at-child-start",
        "PAGEDSERVE_TEST_ADDED": "at-child-start",
    }
    assert f"stderr of {proc.pid}" in written
    assert proc.exitcode == 3  # the status the server reaped, as a spawned child's


@forkserver_only
def test_a_server_with_live_children_is_kept_and_a_new_environment_spawns(
    light_server, monkeypatch
) -> None:
    """A change of an import-time variable restarts the server, unless its children still run:
    then ranks are spawned, and the children keep their server (a SIGKILL still reads as one).
    A server that died is replaced by the next start."""
    ctx, method = rank_context("forkserver")
    assert method == "forkserver"
    started = server_pid()
    proc, conn = _start(ctx, [], exit_code=-1)
    conn.recv()
    monkeypatch.setenv("PYTHON_PAGEDSERVE_TEST_KEY", uuid.uuid4().hex)
    assert rank_context("forkserver")[1] == "spawn"
    assert server_pid() == started
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert rank_context("forkserver")[1] == "forkserver"  # idle now: restarted
    restarted = server_pid()
    assert restarted not in (None, started)
    os.kill(restarted, signal.SIGKILL)  # a server that died is replaced
    _wait_exited(restarted)
    ctx, method = rank_context("forkserver")
    assert method == "forkserver" and server_pid() not in (None, restarted)
    proc, conn = _start(ctx, [], exit_code=0)
    proc.join(60)
    assert proc.exitcode == 0


@forkserver_only
def test_a_rank_sees_a_variable_set_after_the_server_started(tmp_path, monkeypatch) -> None:
    """The ranks read $PAGEDSERVE_CPU_KVCACHE_SPACE when they size their KV cache: set after
    the server started, a bad value still reaches them (and fails the start, naming it)."""
    monkeypatch.setenv(WORKER_MULTIPROC_METHOD_ENV, "forkserver")
    monkeypatch.delenv(CPU_KVCACHE_SPACE_ENV, raising=False)
    forkserver_context()
    started = server_pid()
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, "-1")
    path = make_tiny_llama(tmp_path / "m", num_layers=2)
    args = EngineArgs(str(path), skip_tokenizer_init=True, tensor_parallel_size=2)
    with pytest.raises(RankFailedError, match=f"{CPU_KVCACHE_SPACE_ENV} must be a positive"):
        LLMEngine.from_engine_args(args)
    assert server_pid() == started
