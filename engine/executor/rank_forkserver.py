"""Rank processes forked from a server that has imported torch and the rank's modules once.

A spawned rank is a fresh interpreter that imports torch and the engine again: seconds of CPU
per rank at every tensor/pipeline-parallel start. The forkserver pays them once per engine
process; each rank is then a fork of it (`PAGEDSERVE_WORKER_MULTIPROC_METHOD`,
engine/executor/start_method.py)::

    driver ── fds + the pickled process (unix socket) ──▶ forkserver: PRELOAD imported
      ▲                                                      │ fork
      └──── the rank's pid, later its exit status ───────────┴──▶ rank (worker_main)

It is the standard library's server (`multiprocessing.forkserver.ForkServer`), as an instance
of our own rather than the process-wide one: our preload list and restarts then touch no one
else's forkserver. What a forked rank would otherwise lack against a spawned one:

- The environment. The server keeps the one it was started with; each rank carries the
  driver's `os.environ` at its start (what differs from the server's) and applies it before it
  unpickles anything (CUDA_VISIBLE_DEVICES, NCCL_*, gloo's and the engine's knobs are read
  later, at init). What the preloaded modules read while they load cannot be applied after the
  fact: the server is keyed on those variables (IMPORT_TIME_PREFIXES), sys.path and the
  interpreter, and restarted when they change; while the old one still has live ranks, the new
  engine's ranks are spawned instead.
- stdout and stderr: the server's are the driver's of the moment it started (pytest swaps them
  per test, a service may redirect them); each rank gets the driver's current ones.
- Exit statuses: the server reaps its children and writes each status once down a pipe, so
  concurrent polls (the executor's monitor thread and its caller) are serialised here, and a
  signal is sent only to a rank not yet seen exited (its pid may be reused once reaped).
- The driver-death rule: a rank's parent is the server, not the driver, so ranks watch
  multiprocessing's parent sentinel, the driver's end of a pipe (engine/executor/worker_proc.py).

Nothing outlives the engine's process: the server exits when the driver and every rank it forked
have closed their end of its "alive" pipe, and ranks exit when their driver does. `__main__` is
not preloaded (a script's top level may initialise CUDA or start threads, which must not happen
in a process that forks); each rank imports it as a spawned one does.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref
from multiprocessing import connection, forkserver, popen_forkserver, resource_tracker, spawn, util
from multiprocessing import context as mp_context
from multiprocessing.connection import wait
from multiprocessing.context import reduction, set_spawning_popen
from typing import Any

logger = logging.getLogger(__name__)

# What the server imports before it forks (engine first: it sets libgomp's spin count before
# torch loads it, as in a spawned rank). `engine.llm` is what scripts import, so a rank's
# re-import of the driver's main module finds it loaded; the model families are small and
# imported by the rank that needs one.
PRELOAD = (
    "engine",
    "engine.llm",
    "engine.executor.worker_proc",
    "engine.executor.rank_rpc",
    "engine.worker.worker",
    "engine.models.decoder",
    "torch.distributed",
)
# Environment variables read while the interpreter starts or the preloaded modules (and the
# libraries torch loads: OpenMP, MKL, oneDNN, OpenBLAS) load: a change restarts the server.
IMPORT_TIME_PREFIXES = (
    "PYTHON",
    "LD_",
    "LANG",
    "LC_",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "DNNL_",
    "ONEDNN_",
    "TORCH",
    "PYTORCH_",
    "TRITON_",
    "HF_",
    "TRANSFORMERS_",
)
_STOP_WAIT_S = 10.0


def import_key() -> tuple[Any, ...]:
    """What a server's preloaded state depends on; a server started under another key is not
    used."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(IMPORT_TIME_PREFIXES)))
    relative = any(not os.path.isabs(p or ".") for p in sys.path)
    cwd = os.getcwd() if relative else None
    return (spawn.get_executable(), tuple(sys.path), cwd, PRELOAD, env)


class _ForkServer(forkserver.ForkServer):
    """The standard library's server, started with the driver's sys.path in place before the
    preload (Python 3.10 and 3.11 ignore the sys.path they pass it, so the preload found the
    modules of whatever sys.path the bare interpreter has), and never restarted behind our back
    under another environment: a server that died fails the start of the rank that needed it."""

    def start(self, preload: tuple[str, ...]) -> None:
        resource_tracker.ensure_running()
        command = (
            "import sys; sys.path[:] = %r; "
            "from multiprocessing.forkserver import main; main(%d, %d, %r)"
        )
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            # The driver and every process forked by the server hold the write end; the server
            # exits when all have closed it.
            alive_r, alive_w = os.pipe()
            try:
                exe = spawn.get_executable()
                code = command % (sys.path, listener.fileno(), alive_r, list(preload))
                args = [exe, *util._args_from_interpreter_flags(), "-c", code]
                pid = util.spawnv_passfds(exe, args, [listener.fileno(), alive_r])
            except BaseException:
                os.close(alive_w)
                raise
            finally:
                os.close(alive_r)
        self._forkserver_address, self._forkserver_alive_fd = address, alive_w
        self._forkserver_pid = pid

    def ensure_running(self) -> None:
        with self._lock:
            if self._forkserver_pid is None:
                raise RuntimeError("the rank forkserver was stopped")


class _Server:
    """One started forkserver: the key and environment it started with, the ranks it forked."""

    def __init__(self, key: tuple[Any, ...]) -> None:
        self.key = key
        self.environ = dict(os.environ)
        self.forkserver = _ForkServer()
        self.forkserver.start(key[3])
        self.popens: weakref.WeakSet[_ServerPopen] = weakref.WeakSet()

    @property
    def pid(self) -> int | None:
        return self.forkserver._forkserver_pid

    def alive(self) -> bool:
        """Whether the server runs; one found exited is reaped here (and never signalled)."""
        pid = self.pid
        if pid is None:
            return False
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == 0:
                return True
        except ChildProcessError:
            pass
        self.forkserver._forkserver_pid = None
        return False

    def busy(self) -> bool:
        return any(popen.poll() is None for popen in list(self.popens))

    def stop(self) -> None:
        """Ends an idle server (SIGTERM: an exit through the interpreter's teardown of torch took
        ~0.5 s, which an engine service's exit waited for) and reaps it."""
        server = self.forkserver
        with server._lock:
            pid, alive_fd = server._forkserver_pid, server._forkserver_alive_fd
            server._forkserver_pid = server._forkserver_alive_fd = None
        if alive_fd is not None:
            os.close(alive_fd)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            _reap(pid, _STOP_WAIT_S)

    def forget(self) -> None:
        """In a forked copy of the driver: lets go of the server without touching it (the
        copy's end of the alive pipe would keep it running)."""
        alive_fd = self.forkserver._forkserver_alive_fd
        self.forkserver = _ForkServer()
        if alive_fd is not None:
            with contextlib.suppress(OSError):
                os.close(alive_fd)


def _reap(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() > deadline:
                logger.warning("The rank forkserver (pid %d) did not exit; killing it.", pid)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.01)
    except ChildProcessError:
        pass


_lock = threading.Lock()
_server: _Server | None = None


def _forget_after_fork() -> None:
    global _lock, _server
    _lock = threading.Lock()
    if _server is not None:
        _server.forget()
    _server = None


def _stop_at_exit() -> None:
    """Reaps an idle server at exit rather than leaving it to exit on its own, orphaned (one
    with ranks left exits after them: they end with their driver)."""
    with _lock:
        if _server is not None and not _server.busy():
            _server.stop()


os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(_stop_at_exit)


def forkserver_context() -> ForkServerRankContext | None:
    """A context whose processes are forked from a server preloaded under the current import
    key (started, or restarted, here); None when the running server has another key and still
    has live ranks (the caller spawns instead)."""
    global _server
    key = import_key()
    with _lock:
        if _server is not None and (_server.key != key or not _server.alive()):
            if _server.key != key and _server.busy():
                logger.info(
                    "The environment the rank forkserver was started with changed while its "
                    "ranks run; spawning these ranks."
                )
                return None
            _server.stop()
            _server = None
        if _server is None:
            _server = _Server(key)
            logger.info("Started the rank forkserver (pid %s).", _server.pid)
        return ForkServerRankContext(_server)


def server_pid() -> int | None:
    """The running rank forkserver's pid (None if none runs)."""
    with _lock:
        return None if _server is None else _server.pid


class ForkServerRankContext(mp_context.ForkServerContext):
    """multiprocessing's forkserver context bound to one of our servers."""

    def __init__(self, server: _Server) -> None:
        super().__init__()
        self._server = server

    def Process(self, *args: Any, **kwargs: Any) -> RankProcess:
        process = RankProcess(*args, **kwargs)
        process._server = self._server
        return process


class RankProcess(mp_context.ForkServerProcess):
    """A process forked from a `_Server`; it takes the driver's environment and standard
    streams with it (`_Inherited`)."""

    _server: _Server

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_server", None)  # the driver's handle, not for the child
        return state

    @staticmethod
    def _Popen(process_obj: RankProcess) -> _ServerPopen:
        return _ServerPopen(process_obj, process_obj._server)

    def start(self) -> None:
        self._inherited = _Inherited(self._server.environ)
        super().start()

    def run(self) -> None:
        self._inherited.apply()
        del self._inherited
        super().run()


class _Inherited:
    """What a spawned process would have from its parent at its start and a forked one has from
    the server: the environment (as changes against the server's) and stdout / stderr."""

    def __init__(self, server_environ: dict[str, str]) -> None:
        environ = dict(os.environ)
        self.set = {k: v for k, v in environ.items() if server_environ.get(k) != v}
        self.unset = [k for k in server_environ if k not in environ]
        self.streams = _StdStreams()

    def apply(self) -> None:
        for name in self.unset:
            os.environ.pop(name, None)
        os.environ.update(self.set)
        self.streams.apply()


class _StdStreams:
    """The driver's fds 1 and 2, sent along with the process (a closed one stays the
    server's)."""

    def __init__(self, fds: tuple[int | None, ...] = ()) -> None:
        self.fds = fds

    def __reduce__(self) -> tuple[Any, ...]:
        # DupFd: the fd travels with the process (only while it is being started).
        return _rebuild_std_streams, tuple(
            reduction.DupFd(fd) if _is_open(fd) else None for fd in (1, 2)
        )

    def apply(self) -> None:
        for target, fd in zip((1, 2), self.fds):
            if fd is None:
                continue
            stream = sys.stdout if target == 1 else sys.stderr
            if stream is not None:
                stream.flush()
            os.dup2(fd, target)
            os.close(fd)


def _rebuild_std_streams(*dup_fds: Any) -> _StdStreams:
    return _StdStreams(tuple(None if d is None else d.detach() for d in dup_fds))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


class _ServerPopen(popen_forkserver.Popen):
    """popen_forkserver.Popen for a server of our own, with polls made safe from several
    threads."""

    def __init__(self, process_obj: RankProcess, server: _Server) -> None:
        self._server = server
        self._poll_lock = threading.Lock()
        super().__init__(process_obj)
        server.popens.add(self)

    def _launch(self, process_obj: RankProcess) -> None:
        # The standard library's launch, asking our server instead of the process-wide one.
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = self._server.forkserver.connect_to_new_process(self._fds)
        # The duplicate of the data pipe's write end is the child's parent sentinel: open
        # while this process lives.
        parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        # The status is written once: two threads reading it at once would see it and EOF
        # (which the standard library reports as 255).
        if flag != os.WNOHANG:
            wait([self.sentinel])
        with self._poll_lock:
            return super().poll(os.WNOHANG)

    def _send_signal(self, sig: int) -> None:
        if self.poll() is None:  # reaped ranks' pids may be reused
            super()._send_signal(sig)
