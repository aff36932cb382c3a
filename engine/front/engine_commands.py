"""What crosses between the asyncio event loop and the engine thread (engine_thread.py):
the commands the loop submits, the per-request output streams the thread fills, and the
stats snapshot it publishes after each step."""

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
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True


END_OF_STREAM = object()  # the request ended with no (further) output


def put_all(items: list[tuple[OutputStream, Any]]) -> None:
    """Runs on the event loop: one step's outputs into their streams."""
    for stream, item in items:
        stream.queue.put_nowait(item)


@dataclass
class AddCommand:
    """A request for the engine thread, built and checked on the caller's side."""

    stream: OutputStream
    request: EngineRequest


@dataclass
class AbortCommand:
    request_ids: list[str]
    # Set when a consumer went away: abort only while this stream still owns the id, so a
    # late abort never hits a newer request that reuses it.
    stream: OutputStream | None = None


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
