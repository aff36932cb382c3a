"""Starts many Python scripts the way `python SCRIPT ARGS...` starts one, each in a child
forked from one interpreter that has already imported torch: the import every benchmark
script begins with (~2 s of CPU each on a 2-core machine) is paid once, not once per script.

    python tests/forked_starts.py  < JSON [[SCRIPT, ARG, ...] or ["-c", CODE], ...]
                                   > JSON [[returncode, stdout and stderr], ...]

A child is the script's own run as far as starting it can tell: `sys.argv`, `sys.path[0]`
(the script's folder, where a file shadowing a package would be found first; '' for `-c`),
`__name__ == "__main__"`, its exit status (an uncaught exception is 1, with its traceback)
and its output. What differs from a fresh interpreter is that torch and what it imports are
already in `sys.modules`; no file under benchmarks/ may take such a name (test_benchmarks.py
checks the names on their own), and test_benchmarks.py starts one script both ways and
compares the two.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import IO


def _run(command: list[str]) -> None:
    if command[0] == "-c":
        sys.argv = ["-c", *command[2:]]
        sys.path.insert(0, "")
        exec(compile(command[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = list(command)
        sys.path.insert(0, os.path.dirname(os.path.abspath(command[0])))
        runpy.run_path(command[0], run_name="__main__")


def exit_status(run: Callable[[], object]) -> int:
    """The exit status `python` gives a program that is `run()` (the SystemExit rules of
    Py_Exit; an uncaught exception is 1, with its traceback)."""
    try:
        run()
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _child(command: list[str]) -> int:
    """The exit status `python` would give `command`."""
    return exit_status(lambda: _run(command))


def start_all(commands: list[list[str]], jobs: int) -> list[tuple[int, str]]:
    """Runs `commands` in forked children, `jobs` at a time: (returncode, output) each."""
    import torch  # noqa: F401  (the shared import, done before the first fork)

    results: list[tuple[int, str]] = [(-1, "")] * len(commands)
    pending = list(enumerate(commands))
    running: dict[int, tuple[int, IO[bytes]]] = {}
    while pending or running:
        while pending and len(running) < jobs:
            index, command = pending.pop(0)
            out = tempfile.TemporaryFile()  # noqa: SIM115 (closed once its child is reaped)
            pid = os.fork()
            if pid == 0:  # the child: its output into `out`, then exit without cleanup
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                code = _child(command)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code & 0xFF)
            running[pid] = (index, out)
        pid, status = os.wait()
        index, out = running.pop(pid)
        with out:
            out.seek(0)
            results[index] = (
                os.waitstatus_to_exitcode(status),
                out.read().decode(errors="replace"),
            )
    return results


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: each child puts its own script's there
    jobs = max(2, os.cpu_count() or 2)
    print(json.dumps(start_all(json.load(sys.stdin), jobs)))
