"""Starts `pagedserve engine` processes the way `python -m services engine ARGS` starts one,
each forked from one interpreter that has already imported torch, transformers and the
engine: the imports an engine process begins with (~7 s of CPU each on a 2-core machine,
most of an engine's start) are paid once per test session, not once per engine. The fleet
tests start and restart a dozen engines a module.

    test process ── requests ──▶ zygote (python tests/services/engine_zygote.py)
        ForkedProcess ◀── pids,      │  imported torch, transformers, engine
        (pid, poll, wait,            │  fork() per start ──▶ engine child
         signals by pid)  ◀── exits  │  waitpid() ──▶ its exit status

A child is the command's own run as far as the tests can tell: its own pid for signals
(SIGTERM drains, SIGKILL, SIGSTOP/SIGCONT), `sys.argv`, its environment and working
directory, `__name__ == "__main__"` for `services`, and its exit status (a signal's as
Popen reports it, negative). What differs from a fresh interpreter is what the zygote
imported; environment variables those modules read at import come from the zygote's
environment, not the child's (the tests vary only ones read at run time). The engine's
fresh start is covered by the tests that start it as `python -m services` (tests/services/
cli, tests/deploy).

Protocol (JSON lines): the test process writes {"args", "env", "cwd"}, the zygote answers
{"pid"}; when a child exits the zygote writes {"exit": pid, "code": returncode}. At the end
of its input the zygote kills the children left and exits.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
from typing import IO

from tests.forked_starts import exit_status

_RUN_SERVICES = "import runpy; runpy.run_module('services', run_name='__main__', alter_sys=True)"


# ---------------------------------------------------------------- the zygote process


def _child(request: dict) -> int:
    """`python -m services ARGS...` here: its exit status (the SystemExit rules of Py_Exit)."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # not the zygote's requests
    os.dup2(2, 1)  # not the zygote's answers: the child's stdout joins its stderr
    sys.argv = ["-m", *request["args"]]
    sys.path.insert(0, os.getcwd())  # where `python -m` looks first
    return exit_status(
        lambda: exec(compile(_RUN_SERVICES, "<zygote>", "exec"), {"__name__": "__main__"})
    )


def _serve() -> None:
    import torch  # noqa: F401  (the shared imports, done before the first fork)
    import transformers
    import transformers.models.auto.configuration_auto
    import transformers.models.llama.configuration_llama  # noqa: F401  (pulls in sympy, ...)

    import engine.front.engine_thread  # noqa: F401

    assert threading.active_count() == 1, "a thread before fork() would not be in the child"
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    children: set[int] = set()
    while True:
        readable = select.select([sys.stdin], [], [], 0.05)[0]
        for pid in list(children):  # reap: each exit reported once
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                answers.write(json.dumps({"exit": pid, "code": code}) + "\n")
        if not readable:
            continue
        line = sys.stdin.readline()
        if not line:  # the test process is gone: so are its engines
            for pid in children:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            return
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.close(answers.fileno())  # the test process hears of the zygote's end only
            code = _child(request)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code & 0xFF)
        children.add(pid)
        answers.write(json.dumps({"pid": pid}) + "\n")


# ---------------------------------------------------------------- the test process


class ForkedProcess:
    """What the tests use of a `subprocess.Popen` for a child of the zygote."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a reaped pid, which may be someone else's now
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    def __init__(self, env: dict[str, str], cwd: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=cwd,
            text=True,
        )
        self.lock = threading.Lock()  # one start at a time: a request, then its pid
        self.changed = threading.Condition()
        self.pids: list[int] = []
        self.exits: dict[int, int] = {}
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, answers: IO[str]) -> None:
        for line in answers:
            answer = json.loads(line)
            with self.changed:
                if "pid" in answer:
                    self.pids.append(answer["pid"])
                else:
                    self.exits[answer["exit"]] = answer["code"]
                self.changed.notify_all()
        with self.changed:  # the zygote died: nothing more will come
            self.pids.append(-1)
            self.changed.notify_all()

    def start(self, args: list[str], env: dict[str, str], cwd: str) -> ForkedProcess:
        """`python -m services ARGS` in a fresh child, with `env` as its environment."""
        with self.lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"args": args, "env": env, "cwd": cwd}) + "\n")
            self.proc.stdin.flush()
            with self.changed:
                # The imports come first: minutes on a loaded machine at worst.
                assert self.changed.wait_for(lambda: self.pids, timeout=600), "no zygote"
                pid = self.pids.pop(0)
        assert pid > 0, "the zygote exited"
        return ForkedProcess(self, pid, args)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self.changed:
            self.changed.wait_for(lambda: pid in self.exits, timeout=timeout)
            return self.exits.get(pid)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the zygote kills its children left, and exits
        self.proc.wait(60)


_zygote: Zygote | None = None


def start(
    args: list[str], env: dict[str, str], cwd: str, base_env: dict[str, str]
) -> ForkedProcess:
    """`python -m services ARGS` with environment `env`, forked from the session's zygote
    (started on first use, with `base_env`: what every child's environment shares)."""
    global _zygote
    if _zygote is None or _zygote.proc.poll() is not None:
        _zygote = Zygote(base_env, cwd)
        atexit.register(_zygote.close)
    return _zygote.start(args, env, cwd)


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder (tests/services): not a child's
    _serve()
