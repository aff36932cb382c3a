"""The thread that owns an `LLMEngine` and runs its step loop for `AsyncLLMEngine`.

Requests cross between asyncio tasks and this thread through a command queue one way and
per-request sinks (`OutputStream`: an asyncio queue; `OutputCallback`: a function) the
other way::

    event loop (any number of tasks)            engine thread (owns LLMEngine)
    submit(AddCommand / AbortCommand /          loop:
           CallCommand)
        └────────────── commands ───────────▶       apply queued adds, aborts, calls
                                                    outputs = engine.step()
        stream.queue ◀── call_soon_threadsafe ──    hand each output to its stream

Only this thread touches the `LLMEngine` and the request-id -> stream table; other
threads read the `EngineStats` snapshot it publishes after every step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from engine.api.errors import EngineDeadError
from engine.api.outputs import PoolingRequestOutput, RequestOutput
from engine.front.engine_commands import (
    END_OF_STREAM,
    AbortCommand,
    AddCommand,
    CallCommand,
    Command,
    EngineStats,
    OutputSink,
    put_all,
)
from engine.front.llm_engine import LLMEngine
from engine.front.step_delay import StepDelay
from engine.observability.kv_event_publisher import KVEventPublisher

logger = logging.getLogger(__name__)


class EngineThread:
    def __init__(self, engine: LLMEngine, log_requests: bool = False) -> None:
        self.engine = engine
        self.log_requests = log_requests
        self._cond = threading.Condition()
        self._commands: deque[Command] = deque()  # guarded by _cond
        self._num_submitted = 0  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self._pausing = False  # guarded by _cond: shutdown_background_loop() asked
        self._failed = False  # guarded by _cond: a rank failed, the next step raises
        # Held by whoever drives the engine: the loop thread, or an `engine_step()` caller
        # while the loop is off. Only its holder touches the engine and the tables below.
        self._drive_lock = threading.Lock()
        self._dead_error: EngineDeadError | None = None  # set under _cond
        self._thread: threading.Thread | None = None
        # Touched only by the holder of _drive_lock.
        self._streams: dict[str, OutputSink] = {}
        self._aborted: list[OutputSink] = []
        self._num_applied = 0
        # Prefix-cache events for routers; recording is off until someone subscribes.
        self.kv_events = KVEventPublisher(engine.kv_cache_manager.block_pool)
        self.stats = self._snapshot()  # replaced, never mutated: safe to read anywhere
        # time.monotonic() when the step now running began; None between steps. Written by
        # the driving thread, read by watchdogs on others (a float swap is atomic).
        self.step_started_at: float | None = None
        # The native id of the thread that runs the latest step (its CPU time is the step's
        # progress for a watchdog: services/engine_service/step_progress.py).
        self.step_thread_id: int | None = None
        self._step_delay = StepDelay.from_env()  # a test hook; None unless asked for
        # A failed rank (multi-process engines) wakes the loop, whose next step raises.
        engine.add_failure_listener(self._wake)

    # ---- any thread -------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead_error

    @property
    def num_submitted(self) -> int:
        with self._cond:
            return self._num_submitted

    def start(self) -> None:
        """Starts the loop thread; again after `pause()` (what was queued meanwhile runs)."""
        with self._cond:
            raise_if_dead(self._dead_error)
            if self.is_alive:
                raise RuntimeError("The background loop is already running.")
            self._pausing = False
            self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
            self._thread.start()

    def pause(self, timeout: float | None) -> None:
        """Ends the loop thread after its current step, keeping every request: they go on
        after `start()` or through `step_once()`."""
        with self._cond:
            thread = self._thread
            if thread is None:
                return
            self._pausing = True
            self._cond.notify_all()
        if thread is threading.current_thread():
            raise RuntimeError("shutdown_background_loop() cannot run on the engine thread.")
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"The background loop did not stop within {timeout} s.")
        with self._cond:
            if self._thread is thread:
                self._thread = None

    def step_once(self) -> bool:
        """One iteration by hand while the loop thread is off: apply the queued commands,
        run one engine step, deliver its outputs. True while requests remain."""
        if self.is_alive:
            raise RuntimeError(
                "engine_step() drives the engine by hand: call shutdown_background_loop() "
                "first (the background loop is running)."
            )
        with self._cond:
            raise_if_dead(self._dead_error)
            commands = list(self._commands)
            self._commands.clear()
        pending = deque(commands)
        with self._drive_lock:
            try:
                self._iterate(pending)
            except BaseException as exc:
                logger.exception("An engine step died; every request fails from now on.")
                self._die(exc, list(pending))
                raise_if_dead(self._dead_error)
            with self._cond:
                queued = bool(self._commands)  # an add held back behind an abort
            return self.engine.has_unfinished_requests() or queued

    def submit(self, command: Command) -> None:
        """Queues a command for the engine thread; raises `EngineDeadError` once stopped."""
        with self._cond:
            raise_if_dead(self._dead_error)
            # With the loop off, commands wait for start_background_loop() / engine_step().
            self._commands.append(command)
            self._num_submitted += 1
            self._cond.notify()

    def call(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future[Any]:
        """Runs `fn(engine)` on the engine thread; await the returned future (from the
        running event loop) for its result."""
        future = asyncio.get_running_loop().create_future()
        if not self.is_alive:  # no loop to wait for: run it here, as its driver
            raise_if_dead(self._dead_error)
            with self._drive_lock:
                CallCommand(fn, future).run(self.engine)
                self.stats = self._snapshot()
            return future
        self.submit(CallCommand(fn, future))
        return future

    def stop(self, timeout: float | None) -> None:
        """Ends the loop after its current step: live requests are aborted, queued ones
        fail with `EngineDeadError`."""
        with self._cond:
            ended = self._dead_error is not None  # died, or stopped before
            self._stopping = True
            if self._dead_error is None:
                self._dead_error = EngineDeadError("The engine was shut down.")
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread.is_alive():
            if thread is not threading.current_thread():
                thread.join(timeout)
            return
        if ended:  # its requests were failed or ended then
            return
        with self._drive_lock:  # no loop thread: end the requests here
            self._close()

    # ---- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        commands: deque[Command] = deque()  # taken from the queue, not applied yet
        with self._drive_lock:
            try:
                while (batch := self._next_commands()) is not None:
                    commands.extend(batch)
                    self._iterate(commands)
            except BaseException as exc:
                logger.exception("The engine loop died; every request fails from now on.")
                self._die(exc, list(commands))
                return
            with self._cond:
                stopping = self._stopping
            if stopping:  # else paused: the requests stay for a restart or engine_step()
                self._close()

    def _iterate(self, commands: deque[Command]) -> None:
        """Applies `commands` (emptying it), runs one step, delivers its outputs. An add
        whose request id belongs to a request aborted by an earlier command of the same
        batch goes back to the queue, with every command after it, for the next iteration:
        this step delivers the aborted request's final output and frees the id (a caller
        that aborts and asks again with the same id, e.g. after a client's stop string)."""
        while commands:
            if self._waits_for_aborted(commands[0]):
                with self._cond:
                    self._commands.extendleft(reversed(commands))
                commands.clear()
                break
            self._apply(commands.popleft())
        self.step_thread_id = threading.get_native_id()
        self.step_started_at = time.monotonic()
        try:
            if self._step_delay is not None and self.engine.has_unfinished_requests():
                self._step_delay.apply()
            outputs = self.engine.step()
        finally:
            self.step_started_at = None
        self._deliver(outputs)
        self._end_aborted_streams()
        self.kv_events.publish()
        self.stats = self._snapshot()

    def _wake(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def _next_commands(self) -> list[Command] | None:
        """The queued commands, waiting for one while the engine has nothing to do; None
        once stopping."""
        with self._cond:
            while (
                not self._stopping
                and not self._pausing
                and not self._commands
                and not self._failed
                and (self.engine.is_sleeping() or not self.engine.has_unfinished_requests())
            ):
                self._cond.wait()
            if self._stopping or self._pausing:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _waits_for_aborted(self, command: Command) -> bool:
        if not isinstance(command, AddCommand) or not self._aborted:
            return False
        held = self._streams.get(command.stream.request_id)
        return held is not None and any(held is stream for stream in self._aborted)

    def _apply(self, command: Command) -> None:
        self._num_applied += 1
        if isinstance(command, CallCommand):
            command.run(self.engine)
            return
        if isinstance(command, AbortCommand):
            for request_id in command.request_ids:
                stream = self._streams.get(request_id)
                if command.stream is not None and stream is not command.stream:
                    continue
                self.engine.abort_request(request_id)
                if stream is not None:
                    self._aborted.append(stream)
                    if self.log_requests:
                        logger.info("Aborted request %s.", request_id)
            return
        stream = command.stream
        request_id = stream.request_id
        if request_id in self._streams:
            stream.put(
                ValueError(f"request_id {request_id!r} is already in use by a live request.")
            )
            return
        try:
            self.engine.add_engine_request(command.request)
        except Exception as exc:  # a bad request fails alone; the caller gets the error
            stream.put(exc)
            return
        self._streams[request_id] = stream
        if self.log_requests:
            logger.info("Added request %s.", request_id)

    def _deliver(self, outputs: list[RequestOutput | PoolingRequestOutput]) -> None:
        """Hands a step's outputs over with one wake-up per event loop, not one per request
        (each `call_soon_threadsafe` writes to the loop's self-pipe)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[OutputSink, Any]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
                if self.log_requests:
                    logger.info("Finished request %s.", output.request_id)
            batches.setdefault(stream.loop, []).append((stream, output))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(put_all, items)
            except RuntimeError:  # its event loop is closed: nobody will read these
                for stream, output in items:
                    if not output.finished:
                        self._streams.pop(stream.request_id, None)
                        self.engine.abort_request(stream.request_id)

    def _end_aborted_streams(self) -> None:
        """Aborted requests without a final output (pooling ones) end their stream here."""
        for stream in self._aborted:
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]
                stream.put(END_OF_STREAM)
        self._aborted.clear()

    def _die(self, exc: BaseException, unapplied: list[Command]) -> None:
        error = EngineDeadError(f"The engine loop died: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        with self._cond:
            self._dead_error = error
            commands = unapplied + list(self._commands)
            self._commands.clear()
        self._fail_all(commands, error)

    def _close(self) -> None:
        """Stopping: abort every live request, deliver the abort outputs, fail the rest."""
        with self._cond:
            commands = list(self._commands)
            self._commands.clear()
        error = self._dead_error or EngineDeadError("The engine was shut down.")
        try:
            self.engine.abort_request(list(self._streams))
            self._deliver(self.engine.step())
        except Exception:
            logger.exception("Aborting the live requests at shutdown failed.")
        self._fail_all(commands, error)
        self.stats = self._snapshot()

    def _fail_all(self, commands: list[Command], error: EngineDeadError) -> None:
        streams = list(self._streams.values())
        streams += [c.stream for c in commands if isinstance(c, AddCommand)]
        self._streams.clear()
        for stream in streams:
            stream.put(error)
        for command in commands:
            if isinstance(command, CallCommand):
                command.resolve(error=EngineDeadError(str(error)))

    def _snapshot(self) -> EngineStats:
        engine = self.engine
        kv = engine.kv_cache_manager
        return EngineStats(
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            num_free_blocks=kv.get_num_free_blocks(),
            num_total_blocks=kv.num_blocks,
            kv_cache_usage=kv.usage,
            num_requests=len(self._streams),
            num_prompt_tokens_total=engine.stat_logger.total_prompt_tokens,
            num_generation_tokens_total=engine.stat_logger.total_generation_tokens,
            num_preemptions_total=engine.scheduler.num_preemptions_total,
            num_commands_applied=self._num_applied,
            is_sleeping=engine.is_sleeping(),
        )


def raise_if_dead(error: EngineDeadError | None) -> None:
    """Raises a fresh copy of `error` (one per caller, so tracebacks do not pile up)."""
    if error is not None:
        raise EngineDeadError(str(error)) from error.__cause__
