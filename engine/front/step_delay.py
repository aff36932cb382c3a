"""A test hook that makes engine steps slow, the way a real slow or a wedged step is.

The stall watchdog of the engine service (services/engine_service/watchdog.py) must tell a
step that is slow but working from one that is wedged. Tests with real processes start an
engine service with ``$PAGEDSERVE_TEST_STEP_DELAY`` set to ``MODE:SECONDS[:STEPS]``:

    busy:12     every step first computes for 12 s (the step thread burns CPU, as a long
                prefill on a loaded machine does): slow, not stalled
    idle:12:3   the first 3 steps with work first sleep 12 s (no thread makes progress, as a
                stuck collective or a wedged driver): a stall

Unset (the default), nothing is added to the step; the variable is read once, when the
engine loop is built.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

STEP_DELAY_ENV = "PAGEDSERVE_TEST_STEP_DELAY"
MODES = ("busy", "idle")


@dataclass
class StepDelay:
    mode: str
    seconds: float
    num_steps: int | None = None  # None: every step

    @classmethod
    def from_env(cls) -> StepDelay | None:
        spec = os.environ.get(STEP_DELAY_ENV, "").strip()
        return cls.parse(spec) if spec else None

    @classmethod
    def parse(cls, spec: str) -> StepDelay:
        parts = spec.split(":")
        try:
            if len(parts) not in (2, 3) or parts[0] not in MODES:
                raise ValueError
            seconds = float(parts[1])
            num_steps = int(parts[2]) if len(parts) == 3 else None
        except ValueError:
            raise ValueError(
                f"${STEP_DELAY_ENV} must be MODE:SECONDS[:STEPS] with MODE in {MODES}, "
                f"got {spec!r}."
            ) from None
        if seconds < 0 or (num_steps is not None and num_steps < 0):
            raise ValueError(f"${STEP_DELAY_ENV}: negative values in {spec!r}.")
        return cls(parts[0], seconds, num_steps)

    def apply(self) -> None:
        """Called at the start of a step that has work; delays it as configured."""
        if self.num_steps is not None:
            if self.num_steps == 0:
                return
            self.num_steps -= 1
        if self.mode == "idle":
            time.sleep(self.seconds)
            return
        deadline = time.monotonic() + self.seconds
        x = 1.0
        while time.monotonic() < deadline:  # pure-Python work: holds the CPU throughout
            for _ in range(10_000):
                x = x * 1.0000001 + 1e-9
