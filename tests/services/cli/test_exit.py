"""How a service process and a parallel engine's rank process end (`_exit_without_teardown`
in services/cli/main.py and engine/executor/worker_proc.py): as the interpreter's own exit
would, less the teardown of its modules. The other non-daemon threads finish, the atexit
handlers run, buffered output comes out and the status is the service's (a rank's: 0); a
caller that passes its own argv to `main` (a test, an embedding) gets the status back
instead of an exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

CHILD = """
import atexit, sys, threading, time
from pathlib import Path
from {module} import _exit_without_teardown

out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
def late():
    time.sleep(0.3)
    (out / "thread").write_text("finished")
threading.Thread(target=late).start()  # not a daemon: the exit waits for it
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()  # a daemon: it does not
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(1)  # never shut down: its idle worker is told to end, as at exit
pool.submit(int).result()
sys.stdout.write("buffered, no newline")
sys.stderr.write("to stderr")
_exit_without_teardown({args})
"""


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "proto")]))


@pytest.mark.parametrize(
    ("module", "args", "status"),
    [("services.cli.main", "3", 3), ("engine.executor.worker_proc", "", 0)],
)
def test_the_exit_keeps_what_the_interpreters_exit_does(tmp_path, module, args, status) -> None:
    child = CHILD.format(module=module, args=args)
    done = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == status, done.stderr[-2000:]
    assert done.stdout == "buffered, no newline"
    assert done.stderr == "to stderr"
    assert (tmp_path / "thread").read_text() == "finished"
    assert (tmp_path / "atexit").read_text() == "ran"


def test_main_with_its_own_argv_returns_the_status(tmp_path: Path) -> None:
    """The engine service on a model that does not exist starts, cannot load and stops with
    status 1: returned to the caller, who goes on (here: prints it, then exits as usual)."""
    missing = tmp_path / "missing"
    code = (
        "from services.cli.main import main\n"
        f"argv = ['engine', '--model', {str(missing)!r}, '--engine-addr', '127.0.0.1:0']\n"
        "print('status', main([*argv, '--log-level', 'ERROR']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "status 1"
