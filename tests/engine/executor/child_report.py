"""A process target for tests/engine/executor/test_rank_start_method.py, in a module that
imports nothing heavy (the child imports it to unpickle the target)."""

from __future__ import annotations

import os
import sys
from typing import Any


def report(conn: Any, names: list[str], exit_code: int) -> None:
    """Sends the values of `names` in this process's environment, writes a line to stderr,
    then exits with `exit_code` (-1: waits on `conn` first, to be killed)."""
    conn.send({name: os.environ.get(name) for name in names})
    print(f"stderr of {os.getpid()}", file=sys.stderr, flush=True)
    if exit_code == -1:
        conn.recv()
    sys.exit(exit_code)
