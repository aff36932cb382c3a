"""An engine Generate call read ahead of the relay, its waiting messages merged: when the
client is behind (its writes slow, or this process busy), every token the engine sent
since the relay's last turn goes to the client in one message per output, as the engine
service does toward us (engine/front/output_merge.py). A relay that keeps up gets the
engine's messages one by one, as they came.

    engine call ──▶ reader task ──▶ pending {index: merged message} ──▶ relay (process, write)

With a stream interval of N tokens (`--stream-interval`, SGLang's knob of the same name)
an output's tokens are held until N have come, the output ends or the call does: fewer,
fuller messages on the client hop even when the client keeps up, at the price of the text
arriving in steps of N tokens. An output's first message is never held (time to first token
is the same at any interval).

A call of the multiplexed hop (replicas/stream_mux.py) is not read by a task of its own: the
reader subscribes to it, and the mux's reader task, in its one pass over each engine batch,
merges each entry here and wakes the relay only if it waits. Per engine message that saves a
task wake-up, an `asyncio.Event` and a queue; the relay's task is the one woken per client
message. A per-request Generate call (`--engine-per-request-calls`, an older engine) keeps
the reader task.

The reader ends with the call; the call's error (a broken or cancelled call) is raised to
the relay after the messages that came before it, so a stream that moves to another replica
has taken in every token the old one sent.
"""

from __future__ import annotations

import asyncio
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


class MergingReader:
    """Async-iterates an engine Generate call's messages, merged per output index while
    they wait. `on_message` runs for each message as it arrives (liveness, counters)."""

    def __init__(self, call: Any, on_message: Any, stream_interval: int = 1) -> None:
        self._pending: dict[int, engine_pb2.EngineGenerateResponse] = {}
        self._interval = stream_interval
        self._started: set[int] = set()  # output indexes whose first message went out
        self._on_message = on_message
        self._waiter: asyncio.Future[None] | None = None  # the relay, waiting
        self._error: BaseException | None = None
        self._done = False
        self._task: asyncio.Future[None] | None = None
        subscribe = getattr(call, "subscribe", None)
        if subscribe is not None:  # the mux pushes (module docstring)
            subscribe(self._arrived, self._ended)
        else:
            self._task = asyncio.ensure_future(self._read(call))

    def _arrived(self, msg: engine_pb2.EngineGenerateResponse) -> None:
        if self._done:
            return  # closed
        self._on_message()
        index = msg.index
        merged = self._pending.get(index)
        if merged is None:
            merged = self._pending[index] = msg
        else:
            merge_engine_messages(merged, msg)
        # The relay waits only while nothing is ripe, and only this output changed: it is
        # woken when this output may go (with an interval, once per client message).
        if self._interval == 1 or self._is_ripe(index, merged):
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

    async def __anext__(self) -> engine_pb2.EngineGenerateResponse:
        while True:
            index = self._ripe()
            if index is not None:
                self._started.add(index)
                return self._pending.pop(index)
            if self._done:
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    def _ripe(self) -> int | None:
        """The first output index whose waiting message may go now."""
        if self._interval == 1 or self._done:
            return next(iter(self._pending), None)
        for index, msg in self._pending.items():
            if self._is_ripe(index, msg):
                return index
        return None

    def _is_ripe(self, index: int, msg: engine_pb2.EngineGenerateResponse) -> bool:
        return (
            len(msg.token_ids) >= self._interval
            or bool(msg.finish_reason)
            or index not in self._started
        )

    @property
    def call_ended(self) -> bool:
        """True once the call ended: every message it sent has arrived."""
        return self._done

    def close(self) -> None:
        """Stops reading (the relay is done with the call, or went away)."""
        if self._task is not None:
            self._task.cancel()
        self._done = True  # what the mux pushes from now on is dropped
