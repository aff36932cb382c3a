"""The driver's side of a multi-process engine: one worker process per rank.

The engine (the driver) keeps the scheduler and the KV-cache manager; the ranks hold the
model. Each step the driver sends every rank one `StepDelta` (engine/distributed/
step_delta.py) and reads one `ModelRunnerOutput` back from the driver rank (TP rank 0 of
the last stage). With pipeline parallelism up to `pipeline_parallel_size` steps are in
flight (vLLM's virtual engines): `submit` sends, `collect` takes outputs in order.
Everything else goes to every rank as `collective_rpc(method, args, kwargs)` over the same
pipes (engine/executor/rank_rpc.py), after the steps sent before it.

Failure: a rank that exits (killed, crashed) or stops beating its heartbeat for
`PAGEDSERVE_RANK_TIMEOUT_S` seconds (default 10) makes the executor fail: every rank is
killed, the waiting call raises `RankFailedError`, and the `on_failure` callback runs (the
engine thread wakes and dies, so the gRPC service turns NOT_SERVING). `shutdown` asks the
ranks to exit and kills any that do not, so no process outlives the engine; a finalizer does
the same when the executor is collected without it (`del llm; gc.collect()`): only the engine
holds the executor (the monitor thread keeps a weak reference).

The failure names the cause, not a symptom. When rank 1 is killed, rank 0's all-reduce
breaks ("Connection reset by peer") and rank 0 may well report first, before rank 1's exit
is even reaped. So the causes rank::

    a rank that died (killed, or exited without reporting)   "rank 1 (pid N) died (SIGKILL)"
    a rank's reported error                                  its traceback
    a rank whose heartbeat stopped (the most silent one)     "has not answered for X s"

and a reported collective error (`CollectiveError`, a symptom) or a closed pipe first waits
up to `_DEATH_GRACE_S` for a rank to be seen dead.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import wait
from typing import Any

from engine.config.resolved import EngineConfig
from engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from engine.executor.rank_procs import describe_exit, free_port, kill_all, stop_ranks
from engine.executor.rank_rpc import DEFAULT_RPC_TIMEOUT_S, raise_first_failure
from engine.executor.start_method import (
    WORKER_MULTIPROC_METHOD_ENV,
    rank_context,
    worker_multiproc_method,
)
from engine.executor.step_delta import StepDeltaBuilder
from engine.executor.worker_proc import REPORTED_ERROR_EXIT_CODE, WorkerSpec, worker_main
from engine.worker.worker import check_rpc_method

logger = logging.getLogger(__name__)

RANK_TIMEOUT_ENV = "PAGEDSERVE_RANK_TIMEOUT_S"
_DEFAULT_RANK_TIMEOUT_S = 10.0
_START_TIMEOUT_S = 600.0  # loading a large model's shard
_POLL_S = 0.25
# How long a broken collective waits for the peer that broke it to be seen dead (its
# sockets close before its exit status can be read; under load the gap can be long).
_DEATH_GRACE_S = 5.0


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
        self._early_outputs: deque[ModelRunnerOutput] = deque()
        on_cuda = config.device_config.device.startswith("cuda")
        num_threads = max(1, torch.get_num_threads() // self.world_size)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx, self.start_method = rank_context(worker_multiproc_method())
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
                config,
            )
            # The spec is unpickled by the rank once it has applied the driver's environment
            # (a forkserver's rank starts with the server's: engine/executor/rank_forkserver.py).
            proc = ctx.Process(
                target=worker_main,
                args=(pickle.dumps(spec), child_conn, heartbeat),
                name=f"pagedserve-rank{rank}",
                daemon=True,
            )
            try:
                proc.start()
            except (OSError, EOFError, RuntimeError) as exc:  # the forkserver died or stopped
                child_conn.close()
                stop_ranks(self._procs, self._conns)
                raise RankFailedError(
                    f"rank {rank} could not be started ({self.start_method}): {exc!r}; "
                    f"{WORKER_MULTIPROC_METHOD_ENV}=spawn starts ranks without the forkserver"
                ) from exc
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
        self._finalizer = weakref.finalize(self, stop_ranks, self._procs, self._conns)
        self._monitor = threading.Thread(
            target=_watch, args=(weakref.ref(self),), name="rank-monitor", daemon=True
        )
        self._monitor.start()
        logger.info(
            "%d ranks ready (%s; tensor_parallel_size=%d, pipeline_parallel_size=%d, %d threads "
            "each on CPU), %d KV blocks",
            self.world_size,
            self.start_method,
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
        self._send_all(pickle.dumps(("step", self._builder.build(scheduler_output))))
        self._num_in_flight += 1

    def _send_all(self, payload: bytes) -> None:
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except OSError as exc:
            self._fail(f"sending to the ranks failed: {exc}")
            self.check_health()

    def skip(self, scheduler_output: SchedulerOutput) -> None:
        """A step with nothing scheduled is not sent; its bookkeeping goes with the next."""
        self._builder.forget(scheduler_output)

    def collect(self) -> ModelRunnerOutput:
        """The oldest in-flight step's output (waits; raises `RankFailedError`)."""
        assert self._num_in_flight > 0, "collect() without a step in flight"
        if self._early_outputs:  # read while a collective_rpc waited
            self._num_in_flight -= 1
            return self._early_outputs.popleft()
        driver = self._conns[self.driver_rank]
        while True:
            self.check_health()
            ready = wait([*self._conns, *(p.sentinel for p in self._procs)], timeout=_POLL_S)
            if driver in ready:
                kind, payload = self._recv(self.driver_rank)
                if kind == "output":
                    self._num_in_flight -= 1
                    return payload
                self._fail(self._cause(kind, payload))
            elif ready:
                self._check_ranks()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.collect()

    # ---- calls to every rank ----------------------------------------------------------

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
    ) -> list[Any]:
        """Runs the `Worker` method `method(*args, **kwargs)` on every rank, after the steps
        sent before it, and returns the results in rank order (engine/executor/
        rank_rpc.py). A rank's exception is raised here with its traceback as the cause;
        the engine goes on. A rank that dies meanwhile fails the executor
        (`RankFailedError`), and so do ranks that have not answered in `timeout_s`: their
        late replies would be read as the answers to later calls."""
        check_rpc_method(method)
        self.check_health()
        self._send_all(pickle.dumps(("rpc", (method, tuple(args), dict(kwargs or {})))))
        replies: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < self.world_size:
            self.check_health()
            if time.monotonic() > deadline:
                silent = [r for r in range(self.world_size) if r not in replies]
                self._fail(f"ranks {silent} did not answer {method}() in {timeout_s} s")
                self.check_health()
            ready = wait([*self._conns, *(p.sentinel for p in self._procs)], timeout=_POLL_S)
            for rank, conn in enumerate(self._conns):
                if conn in ready:
                    self._take_reply(rank, replies)
            if any(p.sentinel in ready for p in self._procs):
                self._check_ranks(read_pipes=False)
        return raise_first_failure(method, [replies[r] for r in range(self.world_size)])

    def _take_reply(self, rank: int, replies: dict[int, tuple[bool, Any]]) -> None:
        """Reads one message of `rank` while a call waits: its reply, or the output of a
        step sent before the call (kept for `collect`), or a failure."""
        kind, payload = self._recv(rank)
        if kind == "rpc_result":
            replies[rank] = payload
        elif kind == "output" and rank == self.driver_rank:
            self._early_outputs.append(payload)
        else:
            self._fail(self._cause(kind, payload))

    def collective_stats(self) -> list[dict[str, float]]:
        """Per rank: steps run and time spent in collectives (`CollectiveStats`)."""
        return self.collective_rpc("collective_stats", timeout_s=60.0)

    # ---- health -----------------------------------------------------------------------

    def check_health(self) -> None:
        with self._lock:
            failure = self._failure
        if failure is not None:
            raise RankFailedError(failure)

    def _check_ranks(self, read_pipes: bool = True) -> None:
        """Fails on the worst cause found (see the module docstring): a rank that died, then
        (`read_pipes`: only the thread that collects outputs reads the pipes) a reported
        error, then the most silent heartbeat."""
        dead = self._dead_rank(grace_s=0.0)
        if dead is not None:
            self._fail(dead)
            return
        if read_pipes:
            for rank, conn in enumerate(self._conns):
                if rank != self.driver_rank and conn.poll():
                    kind, message = self._recv(rank)
                    self._fail(self._cause(kind, message))
                    return
        silent = self._most_silent_rank()
        if silent is not None:
            self._fail(silent)

    def _recv(self, rank: int) -> tuple[str, Any]:
        try:
            return self._conns[rank].recv()
        except (EOFError, OSError):
            return "closed", f"rank {rank} closed its pipe"

    def _cause(self, kind: str, message: Any) -> str:
        """A rank's report, unless it is a symptom (a broken collective, a closed pipe) of
        a rank that died, which then is the cause."""
        grace_s = 0.0 if kind == "error" else _DEATH_GRACE_S
        return self._dead_rank(grace_s) or str(message)

    def _dead_rank(self, grace_s: float) -> str | None:
        """The first rank that died (exited other than after reporting an error), waiting
        up to `grace_s` for one; None if none did."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, proc in enumerate(self._procs):
                code = proc.exitcode
                if code is not None and code != REPORTED_ERROR_EXIT_CODE:
                    return f"rank {rank} (pid {proc.pid}) died ({describe_exit(code)})"
            running = [p.sentinel for p in self._procs if p.exitcode is None]
            left = deadline - time.monotonic()
            if not running or left <= 0:
                return None
            wait(running, timeout=left)

    def _most_silent_rank(self) -> str | None:
        """The rank silent the longest past `rank_timeout_s`: one that hangs, or one that
        exited after reporting an error nobody read."""
        now = time.monotonic()
        silences = [now - beat.value for beat in self._heartbeats]
        rank = max(range(self.world_size), key=silences.__getitem__)
        if silences[rank] <= self.rank_timeout_s:
            return None
        proc = self._procs[rank]
        if proc.exitcode is not None:
            return f"rank {rank} (pid {proc.pid}) exited after an error ({proc.exitcode})"
        return f"rank {rank} (pid {proc.pid}) has not answered for {silences[rank]:.1f} s"

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
                kind, payload = self._recv(rank)
                if kind != expected:
                    raise RankFailedError(self._cause(kind, payload))
                values[rank] = payload
            for rank, proc in enumerate(self._procs):
                if proc.sentinel in ready and rank not in values:
                    if self._conns[rank].poll():  # its error message came first
                        continue
                    raise RankFailedError(self._dead_rank(grace_s=0.0) or f"rank {rank} exited")
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
            stop_ranks(self._procs, self._conns)

    def _kill_all(self) -> None:
        kill_all(self._procs)


def _watch(executor_ref: weakref.ref[MultiprocExecutor]) -> None:
    """Notices a failed rank while the engine is idle too. Holds the executor only for
    one check at a time, and ends when it is failed, shut down or collected."""
    while True:
        executor = executor_ref()
        if executor is None or executor._failure is not None:
            return
        # Only the running ranks: an exited one's sentinel is ready at once (a busy loop).
        sentinels = [p.sentinel for p in executor._procs if p.exitcode is None]
        del executor
        if sentinels:
            wait(sentinels, timeout=_POLL_S)
        else:
            time.sleep(_POLL_S)
        executor = executor_ref()
        if executor is None or executor._failure is not None:
            return
        executor._check_ranks(read_pipes=False)
        del executor
