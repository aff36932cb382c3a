"""What crosses between the asyncio event loop and the engine thread (engine_thread.py):
the commands the loop submits, the per-request output sinks the thread fills (a queue read
by the request's generator, or a callback), and the stats snapshot it publishes after each
step."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.core.engine_request import EngineRequest

if TYPE_CHECKING:
    from engine.front.llm_engine import LLMEngine


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine, taken by the engine thread after each step."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    num_requests: int = 0  # requests whose outputs are still being delivered
    num_prompt_tokens_total: int = 0
    num_generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    num_commands_applied: int = 0  # adds and aborts the engine thread has taken in
    is_sleeping: bool = False  # sleep(): requests wait for wake_up()


class OutputStream:
    """Where one request's outputs go: an asyncio queue on the caller's event loop.

    Items are outputs, an exception to raise in the caller, or `END_OF_STREAM`."""

    __slots__ = ("loop", "queue", "request_id")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> bool:
        """Called from the engine thread; False when the event loop is closed."""
        return _put(self, item)

    def deliver(self, item: Any) -> None:
        """On the event loop: the item into the queue."""
        self.queue.put_nowait(item)


class OutputCallback:
    """Where one request's outputs go when its consumer takes each one as it comes
    (`AsyncLLMEngine.generate_into`): `on_output(output)`, called on the event loop inside
    the engine thread's one hand-over per step, so a step's outputs reach their consumers
    without a task woken per request; `done` resolves when the request has ended.

    `ended` tells how: True once the engine is done with the request (its finished output,
    `END_OF_STREAM`, or an error of the engine's); False while it lives, and after an error
    of `on_output` or a cancelled `done` (the consumer left: the request must be aborted).
    Nothing is handed over once `done` is resolved."""

    __slots__ = ("done", "ended", "loop", "on_output", "request_id")

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        on_output: Callable[[Any], None],
    ) -> None:
        self.request_id = request_id
        self.loop = loop
        self.on_output = on_output
        self.done: asyncio.Future[None] = loop.create_future()
        self.ended = False

    def put(self, item: Any) -> bool:
        """Called from the engine thread; False when the event loop is closed."""
        return _put(self, item)

    def deliver(self, item: Any) -> None:
        """On the event loop: an output to `on_output`, or the end of the request."""
        done = self.done
        if done.done():  # the consumer left, or the request ended
            return
        if item is END_OF_STREAM or isinstance(item, BaseException):
            self.ended = True
            if item is END_OF_STREAM:
                done.set_result(None)
            else:
                done.set_exception(item)
            return
        try:
            self.on_output(item)
        except Exception as exc:  # the consumer's error: it ends the request (aborted)
            done.set_exception(exc)
            return
        if item.finished:
            self.ended = True
            done.set_result(None)


OutputSink = OutputStream | OutputCallback

END_OF_STREAM = object()  # the request ended with no (further) output


def _put(sink: OutputSink, item: Any) -> bool:
    try:
        sink.loop.call_soon_threadsafe(sink.deliver, item)
    except RuntimeError:
        return False
    return True


def put_all(items: list[tuple[OutputSink, Any]]) -> None:
    """Runs on the event loop: one step's outputs into their streams."""
    for sink, item in items:
        sink.deliver(item)


@dataclass
class AddCommand:
    """A request for the engine thread, built and checked on the caller's side."""

    stream: OutputSink
    request: EngineRequest


@dataclass
class AbortCommand:
    request_ids: list[str]
    # Set when a consumer went away: abort only while this stream still owns the id, so a
    # late abort never hits a newer request that reuses it.
    stream: OutputSink | None = None


@dataclass
class CallCommand:
    """Runs `fn(engine)` on the engine thread (between steps) and resolves `future`, on
    its event loop, with the result or the error."""

    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]

    def run(self, engine: LLMEngine) -> None:
        try:
            result = self.fn(engine)
        except Exception as exc:  # the caller gets it; the engine goes on
            self.resolve(error=exc)
        else:
            self.resolve(result)

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if self.future.done():  # the caller gave up
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        with contextlib.suppress(RuntimeError):  # its event loop is closed
            self.future.get_loop().call_soon_threadsafe(settle)


Command = AddCommand | AbortCommand | CallCommand
