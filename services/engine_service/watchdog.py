"""A hung engine must not look healthy: a watchdog thread that notices a wedged step.

A step that does not return (a stuck collective, a wedged driver, a rank stopped with
SIGSTOP) leaves the engine thread blocked while the event loop still answers health checks.
A step that is merely slow (a long prefill chunk, a large batch on few cores, a machine
shared with noisy neighbours) must not be mistaken for one: the rule is **no progress for
`timeout_s` seconds while a step runs**, not "a step ran longer than `timeout_s`". Progress
is CPU time used by the threads and rank processes that run the step (step_progress.py):

    engine thread:   step ── step ── long busy step (CPU used) ── step ── wedged (no CPU) ─ ...
    watchdog:        poll    poll    poll   poll   poll   poll    poll    poll ... (> timeout
                                     (progress: never stalled)            without progress:
                                                                          stalled)

Every `poll_s` seconds this thread (neither of them) reads the step's running time
(`AsyncLLMEngine.step_running_s`) and the work done since its last poll, and calls
`on_change(True, seconds)` once a step has gone `timeout_s` without progress, then
`on_change(False, 0.0)` when it progresses or returns again.

The engine service turns both health services NOT_SERVING while stalled (SERVING again once
it recovers, unless it is draining or dead); the tokenizer service then moves the streams
to another replica if one can take them (else they wait here, bounded by their deadlines),
and cancels its calls here, which frees their blocks once the step returns.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from engine import AsyncLLMEngine
from services.engine_service.step_progress import ProgressClock, StepWork

logger = logging.getLogger("services.engine")


class EngineWatchdog:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        timeout_s: float,
        on_change: Callable[[bool, float], None],
        poll_s: float | None = None,
        work: StepWork | None = None,
    ) -> None:
        """`work`: what counts as the step's progress (by default the CPU time of the
        engine's step thread and rank processes: step_progress.py)."""
        if timeout_s <= 0:
            raise ValueError(f"engine_stall_timeout must be > 0 seconds, got {timeout_s}.")
        self.engine = engine
        self.timeout_s = timeout_s
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 4)
        self.on_change = on_change
        self.stalled = False
        self.work = work if work is not None else StepWork(engine.step_workers)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-watchdog", daemon=True)

    def start(self) -> EngineWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        clock = ProgressClock(self.work)
        while not self._stop.wait(self.poll_s):
            if self.engine.errored:
                return  # a dead engine is reported by the engine service itself
            running_s = self.engine.step_running_s()
            # No progress for longer than the step has run is the step before's work.
            idle_s = min(clock.poll(step_running=running_s > 0), running_s)
            stalled = idle_s > self.timeout_s
            if stalled == self.stalled:
                continue
            self.stalled = stalled
            if stalled:
                logger.error(
                    "engine step stalled: no progress",
                    extra={"seconds": round(idle_s, 1), "step_seconds": round(running_s, 1)},
                )
            else:
                logger.warning("engine step progressing again after a stall")
            self.on_change(stalled, idle_s)
