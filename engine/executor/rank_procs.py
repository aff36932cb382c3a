"""The rank processes' plumbing for `MultiprocExecutor`: stopping and killing them, naming
how one exited, and a free port for their rendezvous."""

from __future__ import annotations

import contextlib
import signal
import socket
import time
from typing import Any


def stop_ranks(procs: list[Any], conns: list[Any]) -> None:
    """Asks every rank to exit; kills those still alive after a grace period (the
    executor's shutdown, and its finalizer when it is collected without one)."""
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send(("shutdown", None))
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    kill_all(procs)
    for conn in conns:
        conn.close()


def kill_all(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(5.0)


def describe_exit(code: int) -> str:
    """-9 -> "killed by SIGKILL"; 1 -> "exit code 1" (`Process.exitcode` conventions)."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
