"""An engine Generate call read ahead of the relay, its waiting messages taken together:
when the client is behind (its writes slow, or this process busy), every token the engine
sent since the relay's last turn goes to the client in one message per output, as the
engine service does toward us (engine/front/output_merge.py). A relay that keeps up gets
the engine's messages one by one, as they came.

    engine call ──▶ reader ──▶ pending {index: [messages]} ──▶ relay (process_messages, write)

What waits for an output is kept as the list of its engine messages, not merged into one
protobuf message as each arrives: the relay's `TextStream.process_messages` reads the
group in one pass (its token ids concatenated once, the finish, usage and cumulative
logprob from the last), so a token costs a list append here instead of a protobuf merge.
`merge_engine_messages` is what such a group means as one engine message.

With a stream interval of N tokens (`--stream-interval`, SGLang's knob of the same name)
an output's tokens are held until N have come, the output ends or the call does: fewer,
fuller messages on the client hop even when the client keeps up, at the price of the text
arriving in steps of N tokens. An output's first message is never held (time to first token
is the same at any interval).

A call of the multiplexed hop (replicas/stream_mux.py) is not read by a task of its own: the
reader subscribes to it, and the mux's reader task, in its one pass over each engine batch,
appends each entry here and wakes the relay only if it waits and the output may go. Per
engine message that saves a task wake-up, an `asyncio.Event` and a queue; the relay's task
is the one woken per client message. A per-request Generate call
(`--engine-per-request-calls`, an older engine) keeps the reader task.

The reader ends with the call; the call's error (a broken or cancelled call) is raised to
the relay after the messages that came before it, so a stream that moves to another replica
has taken in every token the old one sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pagedserve.v1 import engine_pb2


def merge_engine_messages(
    first: engine_pb2.EngineGenerateResponse, later: engine_pb2.EngineGenerateResponse
) -> engine_pb2.EngineGenerateResponse:
    """`later` appended to `first` (one output index), in place: tokens and logprobs
    concatenated; the finish, stop reason, usage (a running count) and cumulative logprob
    of the later one."""
    first.token_ids.extend(later.token_ids)
    if later.logprobs:  # (cheap checks first: this runs per token while a client is behind)
        first.logprobs.extend(later.logprobs)
    if later.prompt_logprobs:
        first.prompt_logprobs.extend(later.prompt_logprobs)
    first.finish_reason = later.finish_reason
    if later.HasField("stop_reason"):
        first.stop_reason.CopyFrom(later.stop_reason)
    first.usage.CopyFrom(later.usage)
    if later.HasField("cumulative_logprob"):
        first.cumulative_logprob = later.cumulative_logprob
    return first


class WaitingOutput:
    """One output's engine messages that waited for the relay, in arrival order (one when
    the relay keeps up), with their token ids concatenated as they came (each message's
    repeated field is read once, here)."""

    __slots__ = ("messages", "token_ids")

    def __init__(self, msg: engine_pb2.EngineGenerateResponse, token_ids: list[int]) -> None:
        self.messages = [msg]
        self.token_ids = token_ids

    def merged(self) -> engine_pb2.EngineGenerateResponse:
        """The one engine message these merge into (a copy)."""
        first = engine_pb2.EngineGenerateResponse()
        first.CopyFrom(self.messages[0])
        for later in self.messages[1:]:
            merge_engine_messages(first, later)
        return first


class MergingReader:
    """Async-iterates an engine Generate call's messages as `WaitingOutput`s: what waited
    for one output index, for `TextStream.process_messages` to take in one pass.
    `on_message` runs as messages arrive (the first answer, liveness): for each one on a
    call of its own; on the multiplexed hop, whose mux reports the replica's liveness per
    batch, for the first of each `WaitingOutput`. `on_taken(n)` runs as the relay takes
    `n` messages at once (counters).

    Nothing is merged per message: a message that arrives while its output waits is
    appended to its `WaitingOutput`, so k waiting tokens cost k list appends here, not k
    protobuf merges."""

    def __init__(
        self,
        call: Any,
        on_message: Callable[[], None],
        stream_interval: int = 1,
        on_taken: Callable[[int], None] | None = None,
    ) -> None:
        self._pending: dict[int, WaitingOutput] = {}
        self._interval = stream_interval
        self._started: set[int] = set()  # output indexes whose first message went out
        self._on_message = on_message
        self._on_taken = on_taken
        self._waiter: asyncio.Future[None] | None = None  # the relay, waiting
        self._error: BaseException | None = None
        self._done = False
        self._task: asyncio.Future[None] | None = None
        subscribe = getattr(call, "subscribe", None)
        self._pushed = subscribe is not None
        if subscribe is not None:  # the mux pushes (module docstring)
            subscribe(self._arrived, self._ended)
        else:
            self._task = asyncio.ensure_future(self._read(call))

    def _arrived(self, msg: engine_pb2.EngineGenerateResponse) -> None:
        if self._done:
            return  # closed
        index = msg.index
        token_ids = msg.token_ids[:]  # a list (the cheapest read of a repeated field)
        waiting = self._pending.get(index)
        if waiting is None:
            self._on_message()
            waiting = self._pending[index] = WaitingOutput(msg, token_ids)
        else:
            if not self._pushed:
                self._on_message()
            waiting.messages.append(msg)
            waiting.token_ids += token_ids
        # The relay waits only while nothing is ripe, and only this output changed: it is
        # woken when this output may go (with an interval, once per client message).
        if (
            self._interval == 1
            or len(waiting.token_ids) >= self._interval
            or msg.finish_reason
            or index not in self._started
        ):
            self._wake()

    def _ended(self, error: BaseException | None) -> None:
        if not self._done:
            self._error = error
            self._done = True
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def _read(self, call: Any) -> None:
        error: BaseException | None = None
        try:
            async for msg in call:
                self._arrived(msg)
        except BaseException as exc:  # the relay raises it, in its own task
            error = exc
        finally:
            self._ended(error)

    def __aiter__(self) -> MergingReader:
        return self

    async def __anext__(self) -> WaitingOutput:
        while True:
            index = self._ripe()
            if index is not None:
                waiting = self._pending.pop(index)
                if self._interval != 1:
                    self._started.add(index)
                if self._on_taken is not None:
                    self._on_taken(len(waiting.messages))
                return waiting
            if self._done:
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    def _ripe(self) -> int | None:
        """The first output index whose waiting messages may go now."""
        if self._interval == 1 or self._done:
            return next(iter(self._pending), None)
        for index, waiting in self._pending.items():
            if (
                len(waiting.token_ids) >= self._interval
                or waiting.messages[-1].finish_reason
                or index not in self._started
            ):
                return index
        return None

    @property
    def call_ended(self) -> bool:
        """True once the call ended: every message it sent has arrived."""
        return self._done

    def close(self) -> None:
        """Stops reading (the relay is done with the call, or went away)."""
        if self._task is not None:
            self._task.cancel()
        self._done = True  # what the mux pushes from now on is dropped
