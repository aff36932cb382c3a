"""How the engine starts its rank processes: `PAGEDSERVE_WORKER_MULTIPROC_METHOD` (vLLM's
`VLLM_WORKER_MULTIPROC_METHOD`).

- `forkserver` (the default where the platform has it, Linux): each rank is forked from a
  server that imported torch and the rank's modules once (engine/executor/rank_forkserver.py),
  so a rank skips the seconds of imports a fresh interpreter pays.
- `spawn` (the default elsewhere): each rank is a fresh interpreter.

`fork` is refused: the engine's process may have initialised CUDA, which a forked child cannot
use; the forkserver is a fresh interpreter that never does.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from multiprocessing.context import BaseContext

WORKER_MULTIPROC_METHOD_ENV = "PAGEDSERVE_WORKER_MULTIPROC_METHOD"
START_METHODS = ("forkserver", "spawn")


def default_start_method() -> str:
    if sys.platform == "linux" and "forkserver" in multiprocessing.get_all_start_methods():
        return "forkserver"
    return "spawn"


def worker_multiproc_method() -> str:
    """$PAGEDSERVE_WORKER_MULTIPROC_METHOD, or the platform's default when unset; ValueError
    naming the variable on any other value."""
    value = os.environ.get(WORKER_MULTIPROC_METHOD_ENV, "").strip().lower()
    if not value:
        return default_start_method()
    if value == "fork":
        raise ValueError(
            f"${WORKER_MULTIPROC_METHOD_ENV}=fork is refused: a process forked from the engine "
            "cannot use CUDA once the engine has initialised it; use forkserver or spawn."
        )
    if value not in START_METHODS:
        raise ValueError(
            f"${WORKER_MULTIPROC_METHOD_ENV} must be one of {START_METHODS}: {value!r}"
        )
    if value not in multiprocessing.get_all_start_methods():
        raise ValueError(f"${WORKER_MULTIPROC_METHOD_ENV}={value}: this platform has no {value}.")
    return value


def rank_context(method: str) -> tuple[BaseContext, str]:
    """The multiprocessing context that starts the ranks, and the method it uses: a
    forkserver's ranks are spawned while a server started under another environment still has
    ranks (rank_forkserver.forkserver_context)."""
    if method == "forkserver":
        from engine.executor.rank_forkserver import forkserver_context

        context = forkserver_context()
        if context is not None:
            return context, "forkserver"
    return multiprocessing.get_context("spawn"), "spawn"
