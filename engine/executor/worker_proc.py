"""A rank's process: joins the world, loads its share of the model, runs the steps.

Started by `MultiprocExecutor`, one per rank: forked from the rank forkserver or spawned
(engine/executor/start_method.py). The conversation over its pipe::

    rank -> driver   ("ready", num_blocks)     the blocks its own memory budget allows
    driver -> rank   ("init_kv", num_blocks)   the minimum over the ranks
    rank -> driver   ("kv_ready", None)        caches allocated, warm-up done
    driver -> rank   ("step", StepDelta) ...   pickled once, sent to every rank
    rank -> driver   ("output", ModelRunnerOutput)   the driver rank only
    driver -> rank   ("rpc", (method, args, kwargs))   a collective_rpc: every rank runs
    rank -> driver   ("rpc_result", (ok, ...))  the `Worker` method (engine/executor/rank_rpc.py)
    driver -> rank   ("shutdown", None)
    rank -> driver   ("error", text)           any failure, then the process exits with
                                               REPORTED_ERROR_EXIT_CODE
    rank -> driver   ("collective_error", text)   the same for a broken collective (a
                                               symptom: the driver looks for a peer that died)

A heartbeat thread stamps a shared clock every `HEARTBEAT_INTERVAL_S`, so the driver sees
a rank that stopped (SIGSTOP, a stuck machine) even while the others wait in a
collective; it also ends the rank when the driver process is gone, so no rank outlives its
engine. The rank watches multiprocessing's parent sentinel, the driver's end of a pipe, which
closes when the driver exits however it ends: a forkserver's rank is the server's child, so
its parent pid says nothing of the driver. (Not PR_SET_PDEATHSIG: it fires when the *thread*
that started the process exits, and engines are often built on a worker thread.)
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import pickle
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from engine.distributed.parallel_state import CollectiveError, destroy_distributed, init_distributed
from engine.executor.step_delta import RequestMirror

HEARTBEAT_INTERVAL_S = 0.5
# The exit code after an error sent over the pipe: the driver tells a rank that reported
# (its message says why) from one that died (killed, crashed without a word).
REPORTED_ERROR_EXIT_CODE = 3

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What one rank is told when it starts (picklable)."""

    rank: int
    tp_size: int
    pp_size: int
    init_method: str  # tcp://127.0.0.1:PORT rendezvous
    backend: str  # "gloo" or "nccl"
    num_threads: int  # intra-op threads on CPU
    config: Any  # the EngineConfig


def worker_main(spec_bytes: bytes, conn: Any, heartbeat: Any) -> None:
    """The rank's entry point (in the rank's process); `spec_bytes`: the pickled
    `WorkerSpec`."""
    driver = multiprocessing.parent_process()
    assert driver is not None, "a rank is started by multiprocessing"
    if not driver.is_alive():  # the driver died while this process started
        os._exit(1)
    threading.Thread(
        target=_beat, args=(heartbeat, driver.sentinel), name="heartbeat", daemon=True
    ).start()
    spec: WorkerSpec | None = None
    try:
        spec = pickle.loads(spec_bytes)
        _serve(spec, conn)
    except BaseException as exc:
        kind = "collective_error" if isinstance(exc, CollectiveError) else "error"
        text = traceback.format_exc()
        rank = "?" if spec is None else spec.rank
        with contextlib.suppress(OSError, EOFError):
            conn.send((kind, f"rank {rank}: {text}"))
        sys.exit(REPORTED_ERROR_EXIT_CODE)
    _exit_without_teardown()


def _exit_without_teardown() -> None:
    """Ends a rank the driver has shut down as multiprocessing's own exit would (non-daemon
    threads joined, atexit handlers and multiprocessing's finalizers run, output flushed,
    status 0), less the teardown of the interpreter's modules: torch's and transformers'
    took a rank ~1.5 s of CPU, which the driver's shutdown waited for."""
    # What the interpreter's exit does first (and multiprocessing's process exit): tells the
    # idle workers of thread pools to end, then joins every non-daemon thread.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(0)


def _serve(spec: WorkerSpec, conn: Any) -> None:
    # torch-side: in the rank process only (the driver imports this module without torch)
    import torch

    from engine.executor.rank_rpc import call_worker
    from engine.worker.worker import Worker

    torch.set_num_threads(spec.num_threads)
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.rank % torch.cuda.device_count())
    init_distributed(spec.rank, spec.tp_size, spec.pp_size, spec.init_method, spec.backend)
    worker = Worker(spec.config, allocate_kv_cache=False)
    runner = worker.runner
    conn.send(("ready", runner.num_blocks))
    kind, num_blocks = conn.recv()
    assert kind == "init_kv", kind
    runner.initialize_kv_cache(num_blocks)
    conn.send(("kv_ready", None))
    mirror = RequestMirror()
    while True:
        kind, payload = conn.recv()
        if kind == "shutdown":
            break
        if kind == "rpc":
            conn.send(("rpc_result", call_worker(worker, *payload)))
            continue
        assert kind == "step", kind
        output = worker.execute_model(mirror.apply(payload))
        if runner.is_driver_rank:
            conn.send(("output", output))
    destroy_distributed()


def _beat(heartbeat: Any, driver_sentinel: int) -> None:
    while True:
        heartbeat.value = time.monotonic()
        if wait([driver_sentinel], timeout=HEARTBEAT_INTERVAL_S):  # the driver is gone
            os._exit(1)
