"""Is the engine step working? The CPU time of the thread and processes that run it.

A step that is slow (a long prefill chunk, a batch of 256 on two cores, a machine shared
with noisy neighbours) keeps its workers on the CPU: the engine thread (also the master of
torch's OpenMP team, so it computes its share of every parallel op) and, for a parallel
engine, the rank processes. A wedged step (a stuck collective, a rank stopped with
SIGSTOP, a driver that never returns, a lock never released) keeps none of them busy. So
the watchdog reads the CPU seconds they used since its last poll and counts a poll interval
in which they used at least `MIN_BUSY_FRACTION` of one core as progress. Threads that only
serve (gRPC, the event loop answering health checks) are not counted: they stay live while
the step is stuck.

On a GPU the engine thread waits for the device in `cudaStreamSynchronize`, which spins by
default, so a step whose kernels are running counts as busy too.

The times are read from /proc (Linux); elsewhere the whole process's CPU time stands in.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

# A poll interval in which the step's workers used at least this share of one core counts as
# progress. A wedged step's thread uses none; a working one, even with 8 busy processes
# sharing its 2 cores, ~20 % or more.
MIN_BUSY_FRACTION = 0.05
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_PROC = Path("/proc")

# (the native id of the thread running the steps or None, the rank processes' pids)
StepWorkers = Callable[[], tuple[int | None, list[int]]]


def stat_cpu_s(stat_path: Path) -> float:
    """utime + stime of a /proc `stat` file in seconds (0.0 if it is gone)."""
    try:
        text = stat_path.read_text()
    except OSError:
        return 0.0
    fields = text[text.rindex(")") + 2 :].split()  # what follows "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime


class StepWork:
    """CPU seconds the step's workers have used; read as differences between polls (a
    thread or process that goes away takes its time with it)."""

    def __init__(self, workers: StepWorkers) -> None:
        self._workers = workers
        self._linux = (_PROC / "self" / "task").is_dir()

    def cpu_s(self) -> float:
        if not self._linux:
            return time.process_time()
        thread_id, pids = self._workers()
        total = 0.0
        if thread_id is not None:
            total += stat_cpu_s(_PROC / "self" / "task" / str(thread_id) / "stat")
        for pid in pids:
            total += stat_cpu_s(_PROC / str(pid) / "stat")
        return total


class ProgressClock:
    """When the step last made progress, from successive `StepWork` readings."""

    def __init__(self, work: StepWork, min_busy_fraction: float = MIN_BUSY_FRACTION) -> None:
        self.work = work
        self.min_busy_fraction = min_busy_fraction
        self._last_cpu_s = work.cpu_s()
        self._last_poll = time.monotonic()
        self.last_progress = self._last_poll

    def poll(self, step_running: bool) -> float:
        """Seconds since the step last made progress (0.0 between steps)."""
        now = time.monotonic()
        cpu_s = self.work.cpu_s()
        used_s = cpu_s - self._last_cpu_s
        busy = used_s >= self.min_busy_fraction * (now - self._last_poll)
        self._last_cpu_s, self._last_poll = cpu_s, now
        if busy or not step_running:
            self.last_progress = now
        return now - self.last_progress
