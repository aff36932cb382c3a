"""What the stall watchdog counts as a step's progress (services/engine_service/step_progress.py):
CPU time of the step's thread and of rank processes, read from /proc. Real threads and
real processes: one that computes, one that sleeps, one stopped with SIGSTOP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from services.engine_service.step_progress import ProgressClock, StepWork

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="per-thread CPU times are read from /proc"
)
BURN = "import time\nx = 1.0\nwhile True:\n    x = x * 1.0000001 + 1e-9\n"


def _thread(target) -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()
    ready = threading.Event()
    ids: list[int] = []

    def run() -> None:
        ids.append(threading.get_native_id())
        ready.set()
        target(stop)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(30)
    thread.native = ids[0]  # type: ignore[attr-defined]
    return thread, stop


def _burn(stop: threading.Event) -> None:
    x = 1.0
    while not stop.is_set():
        x = x * 1.0000001 + 1e-9


def _until_used(work: StepWork, seconds: float, timeout: float = 120.0) -> float:
    start = work.cpu_s()
    deadline = time.monotonic() + timeout
    while work.cpu_s() - start < seconds:
        assert time.monotonic() < deadline, "the busy worker got no CPU time"
        time.sleep(0.05)
    return work.cpu_s() - start


def test_a_computing_thread_counts_a_sleeping_one_does_not() -> None:
    busy, stop_busy = _thread(_burn)
    idle, stop_idle = _thread(lambda stop: stop.wait())
    try:
        assert _until_used(StepWork(lambda: (busy.native, [])), 0.2) >= 0.2
        idle_work = StepWork(lambda: (idle.native, []))
        before = idle_work.cpu_s()
        time.sleep(0.5)
        assert idle_work.cpu_s() - before <= 0.02
    finally:
        stop_busy.set()
        stop_idle.set()


def test_rank_processes_count_until_stopped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", BURN])
    try:
        work = StepWork(lambda: (None, [proc.pid]))
        assert _until_used(work, 0.2) >= 0.2
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.2)  # let the stop land
        before = work.cpu_s()
        time.sleep(0.5)
        assert work.cpu_s() - before <= 0.02
        assert StepWork(lambda: (None, [2**22 + 7])).cpu_s() == 0.0  # a pid that is gone
    finally:
        proc.kill()
        proc.wait()


def test_the_clock_runs_only_without_progress() -> None:
    idle, stop_idle = _thread(lambda stop: stop.wait())
    busy, stop_busy = _thread(_burn)
    try:
        clock = ProgressClock(StepWork(lambda: (idle.native, [])))
        time.sleep(0.3)
        assert clock.poll(step_running=True) >= 0.3  # a running step, no CPU: idle time grows
        assert clock.poll(step_running=False) == 0.0  # between steps nothing is stalled

        busy_work = StepWork(lambda: (busy.native, []))
        clock = ProgressClock(busy_work)
        _until_used(busy_work, 0.1)
        assert clock.poll(step_running=True) == 0.0
    finally:
        stop_idle.set()
        stop_busy.set()
