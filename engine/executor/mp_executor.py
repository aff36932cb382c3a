"""The driver's side of a multi-process engine: one worker process per rank.

The engine (the driver) keeps the scheduler and the KV-cache manager; the ranks hold the
model. Each step the driver sends every rank one `StepDelta` (engine/distributed/
step_delta.py) and reads one `ModelRunnerOutput` back from the driver rank (TP rank 0 of
the last stage). With pipeline parallelism up to `pipeline_parallel_size` steps are in
flight (vLLM's virtual engines): `submit` sends, `collect` takes outputs in order.

Failure: a rank that exits (killed, crashed) or stops beating its heartbeat for
`PAGEDSERVE_RANK_TIMEOUT_S` seconds (default 10) makes the executor fail: every rank is
killed, the waiting call raises `RankFailedError`, and the `on_failure` callback runs (the
engine thread wakes and dies, so the gRPC service turns NOT_SERVING). `shutdown` asks the
ranks to exit and kills any that do not, so no process outlives the engine; a finalizer does
the same when the executor is collected without it (`del llm; gc.collect()`): only the engine
holds the executor (the monitor thread keeps a weak reference).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import socket
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from engine.config.engine_config import EngineConfig
from engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from engine.executor.step_delta import StepDeltaBuilder
from engine.executor.worker_proc import WorkerSpec, worker_main

logger = logging.getLogger(__name__)

RANK_TIMEOUT_ENV = "PAGEDSERVE_RANK_TIMEOUT_S"
_DEFAULT_RANK_TIMEOUT_S = 10.0
_START_TIMEOUT_S = 600.0  # loading a large model's shard
_POLL_S = 0.25


class RankFailedError(RuntimeError):
    """A rank died or stopped answering; the engine cannot go on."""


class MultiprocExecutor:
    runner = None  # the model lives in the ranks

    def __init__(self, config: EngineConfig, on_failure: Callable[[], None] | None = None) -> None:
        import torch

        parallel = config.parallel_config
        self.tp_size, self.pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        self.world_size = parallel.world_size
        self.max_concurrent_batches = self.pp_size
        self.rank_timeout_s = float(os.environ.get(RANK_TIMEOUT_ENV, _DEFAULT_RANK_TIMEOUT_S))
        self._on_failure = on_failure
        self._failure: str | None = None
        self._lock = threading.Lock()
        self._builder = StepDeltaBuilder(config.model_config.vocab_size)
        self._num_in_flight = 0
        on_cuda = config.device_config.device.startswith("cuda")
        num_threads = max(1, torch.get_num_threads() // self.world_size)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = multiprocessing.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._heartbeats: list[Any] = []
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            heartbeat = ctx.Value("d", time.monotonic(), lock=False)
            spec = WorkerSpec(
                rank,
                self.tp_size,
                self.pp_size,
                init_method,
                "nccl" if on_cuda else "gloo",
                num_threads,
                os.getpid(),
                config,
            )
            proc = ctx.Process(
                target=worker_main,
                args=(spec, child_conn, heartbeat),
                name=f"pagedserve-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
            self._heartbeats.append(heartbeat)
        # TP rank 0 of the last stage samples and answers.
        self.driver_rank = (self.pp_size - 1) * self.tp_size
        try:
            blocks = self._gather("ready", _START_TIMEOUT_S)
            self.num_blocks = min(blocks)
            for conn in self._conns:
                conn.send(("init_kv", self.num_blocks))
            self._gather("kv_ready", _START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        # Neither the monitor thread nor anything else outside holds the executor strongly,
        # so an engine dropped by its user (`del llm; gc.collect()`) is collected, and the
        # finalizer stops its ranks then (not only when the interpreter exits).
        self._finalizer = weakref.finalize(self, _stop_ranks, self._procs, self._conns)
        self._monitor = threading.Thread(
            target=_watch, args=(weakref.ref(self),), name="rank-monitor", daemon=True
        )
        self._monitor.start()
        logger.info(
            "%d ranks ready (tensor_parallel_size=%d, pipeline_parallel_size=%d, %d threads "
            "each on CPU), %d KV blocks",
            self.world_size,
            self.tp_size,
            self.pp_size,
            num_threads,
            self.num_blocks,
        )

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    # ---- steps ------------------------------------------------------------------------

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Sends the step to every rank (its output comes back through `collect`)."""
        self.check_health()
        payload = pickle.dumps(("step", self._builder.build(scheduler_output)))
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except OSError as exc:
            self._fail(f"sending a step to the ranks failed: {exc}")
            self.check_health()
        self._num_in_flight += 1

    def skip(self, scheduler_output: SchedulerOutput) -> None:
        """A step with nothing scheduled is not sent; its bookkeeping goes with the next."""
        self._builder.forget(scheduler_output)

    def collect(self) -> ModelRunnerOutput:
        """The oldest in-flight step's output (waits; raises `RankFailedError`)."""
        assert self._num_in_flight > 0, "collect() without a step in flight"
        driver = self._conns[self.driver_rank]
        while True:
            self.check_health()
            ready = wait([*self._conns, *(p.sentinel for p in self._procs)], timeout=_POLL_S)
            if driver in ready:
                kind, payload = driver.recv()
                if kind == "output":
                    self._num_in_flight -= 1
                    return payload
                self._fail(str(payload))
            elif ready:
                self._check_ranks()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.collect()

    def collective_stats(self) -> list[dict[str, float]]:
        """Per rank: steps run and time spent in collectives (`CollectiveStats`). Only
        between steps (nothing in flight)."""
        if self._num_in_flight:
            raise RuntimeError("collective_stats() needs every submitted step collected.")
        self.check_health()
        for conn in self._conns:
            conn.send(("stats", None))
        return self._gather("stats", 60.0)

    # ---- health -----------------------------------------------------------------------

    def check_health(self) -> None:
        with self._lock:
            failure = self._failure
        if failure is not None:
            raise RankFailedError(failure)

    def _check_ranks(self, read_pipes: bool = True) -> None:
        """Fails on a rank that exited, stopped its heartbeat, or (`read_pipes`: only the
        thread that collects outputs reads the pipes) reported an error."""
        now = time.monotonic()
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True)):
            if read_pipes and rank != self.driver_rank and conn.poll():
                try:
                    _, message = conn.recv()
                except (EOFError, OSError):
                    message = f"rank {rank} closed its pipe"
                self._fail(str(message))
                return
            if not proc.is_alive():
                self._fail(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")
                return
            silent = now - self._heartbeats[rank].value
            if silent > self.rank_timeout_s:
                self._fail(f"rank {rank} (pid {proc.pid}) has not answered for {silent:.1f} s")
                return

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = reason
        logger.error("Tensor/pipeline-parallel engine failed: %s; stopping every rank.", reason)
        self._kill_all()
        if self._on_failure is not None:
            self._on_failure()

    def _gather(self, expected: str, timeout: float) -> list[Any]:
        """One `expected` message from every rank, in rank order (start-up)."""
        values: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(values) < self.world_size:
            if time.monotonic() > deadline:
                raise RankFailedError(f"the ranks did not report {expected!r} in {timeout} s")
            pending = [c for r, c in enumerate(self._conns) if r not in values]
            ready = wait([*pending, *(p.sentinel for p in self._procs)], timeout=_POLL_S)
            for rank, conn in enumerate(self._conns):
                if rank in values or conn not in ready:
                    continue
                kind, payload = conn.recv()
                if kind != expected:
                    raise RankFailedError(str(payload))
                values[rank] = payload
            for rank, proc in enumerate(self._procs):
                if proc.sentinel in ready and rank not in values:
                    if self._conns[rank].poll():  # its error message came first
                        continue
                    raise RankFailedError(f"rank {rank} exited with code {proc.exitcode}")
        return [values[rank] for rank in range(self.world_size)]

    # ---- shutdown ---------------------------------------------------------------------

    def shutdown(self) -> None:
        """Asks every rank to exit; kills those still alive after a grace period."""
        with self._lock:
            if self._failure is None:
                self._failure = "the engine was shut down"
        if hasattr(self, "_finalizer"):
            self._finalizer()  # runs _stop_ranks once
        else:  # start-up failed before the finalizer existed
            _stop_ranks(self._procs, self._conns)

    def _kill_all(self) -> None:
        _kill_all(self._procs)


def _watch(executor_ref: weakref.ref[MultiprocExecutor]) -> None:
    """Notices a failed rank while the engine is idle too. Holds the executor only for
    one check at a time, and ends when it is failed, shut down or collected."""
    while True:
        executor = executor_ref()
        if executor is None or executor._failure is not None:
            return
        sentinels = [p.sentinel for p in executor._procs]
        del executor
        wait(sentinels, timeout=_POLL_S)
        executor = executor_ref()
        if executor is None or executor._failure is not None:
            return
        executor._check_ranks(read_pipes=False)
        del executor


def _stop_ranks(procs: list[Any], conns: list[Any]) -> None:
    """Asks every rank to exit; kills those still alive after a grace period (the
    executor's shutdown, and its finalizer when it is collected without one)."""
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send(("shutdown", None))
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    _kill_all(procs)
    for conn in conns:
        conn.close()


def _kill_all(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(5.0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
