"""A hung engine must not look healthy: a watchdog thread that notices a stuck step.

A step that does not return (a stuck collective, a wedged driver, a rank stopped with
SIGSTOP) leaves the engine thread blocked while the event loop still answers health checks.
This thread, which is neither of them, reads how long the current step has been running
(`AsyncLLMEngine.step_running_s`) every `poll_s` seconds and calls `on_change(True, seconds)`
once it passes `timeout_s`, then `on_change(False, 0.0)` when steps return again:

    engine thread:   step ─── step ─── step ──────────── stuck ───────────── step ─ ...
    watchdog:        poll     poll     poll     poll (> timeout: stalled)     poll (recovered)

The engine service turns both health services NOT_SERVING while stalled (SERVING again once
it recovers, unless it is draining or dead); the tokenizer service then moves the streams
away, and cancels its calls here, which frees their blocks once the step returns.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from engine import AsyncLLMEngine

logger = logging.getLogger("services.engine")


class EngineWatchdog:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        timeout_s: float,
        on_change: Callable[[bool, float], None],
        poll_s: float | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"engine_stall_timeout must be > 0 seconds, got {timeout_s}.")
        self.engine = engine
        self.timeout_s = timeout_s
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 4)
        self.on_change = on_change
        self.stalled = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-watchdog", daemon=True)

    def start(self) -> EngineWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.engine.errored:
                return  # a dead engine is reported by the engine service itself
            running_s = self.engine.step_running_s()
            stalled = running_s > self.timeout_s
            if stalled == self.stalled:
                continue
            self.stalled = stalled
            if stalled:
                logger.error("engine step stalled", extra={"seconds": round(running_s, 1)})
            else:
                logger.warning("engine steps returned after a stall")
            self.on_change(stalled, running_s)
