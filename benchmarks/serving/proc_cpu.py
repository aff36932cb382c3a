"""CPU seconds of the processes a serving benchmark starts, read from /proc, and a free port
to start them on: what tier_cost.py, service_start.py and grpc_stream_floor.py measure the
real `pagedserve` processes with (user + system time, as `ps` and `top` count it)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stat_cpu_s(stat: Path) -> float:
    """utime + stime of a /proc stat file, in seconds (fields after the command's name)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid`, its threads included."""
    return _stat_cpu_s(Path(f"/proc/{pid}/stat"))


def process_tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and of its live descendants (tokenizer workers)."""
    total = 0.0
    try:
        total += process_cpu_s(pid)
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += process_tree_cpu_s(int(child))
    except (FileNotFoundError, ProcessLookupError):
        pass
    return total


def main_thread_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid`'s main thread: in a service, its asyncio event
    loop (the engine service's engine loop and torch's threads are other threads)."""
    try:
        return _stat_cpu_s(Path(f"/proc/{pid}/task/{pid}/stat"))
    except (FileNotFoundError, ProcessLookupError):
        return float("nan")
