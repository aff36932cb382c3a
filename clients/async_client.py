"""`AsyncClient`: the asyncio client of pagedserve's public API (the same methods as
`Client`, awaited), over grpc.aio.

    async with AsyncClient("localhost:50051") as client:
        async for delta in client.generate("The capital of France is", max_tokens=16):
            print(delta.text, end="", flush=True)

Leaving `async for` early, `await stream.aclose()` / `stream.cancel()`, or the end of an
`async with client.generate(...) as stream:` block cancels the call; the server aborts the
request. A channel belongs to the event loop it was made on: make the client in a coroutine.

The methods, their requests and replies are `clients.calls`; the state and policies
`clients.core`. This file is the transport: awaited calls and reads, `asyncio.sleep`, and
asyncio's task cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import grpc

from clients import calls
from clients.core import ClientCore, StreamCore, method_of
from clients.outputs import GenerationDelta, GenerationResult, ResultBuilder
from pagedserve.v1 import generation_pb2

if TYPE_CHECKING:
    from clients.requests import Message

P = ParamSpec("P")
T = TypeVar("T")


def _task_cancelling() -> bool:
    """Whether the current task is being cancelled (Python >= 3.11 can tell)."""
    task = asyncio.current_task()
    return task is not None and getattr(task, "cancelling", lambda: 0)() > 0


class AsyncGenerationStream(StreamCore):
    """The deltas of one Generate call, as they arrive (`async for`). UNAVAILABLE before
    the first message is retried (`RetryPolicy`); after it, every failure is raised."""

    END = StopAsyncIteration

    def __aiter__(self) -> AsyncGenerationStream:
        return self

    async def __anext__(self) -> GenerationDelta:
        self._check_open()
        try:
            msg = await (self._read() if self._started else self._first_message())
        except grpc.RpcError as exc:
            raise self._failed(exc) from None
        except asyncio.CancelledError:
            self._done = True
            if self._cancelled and not _task_cancelling():
                raise StopAsyncIteration from None  # cancelled by its owner: just ends
            raise
        return self._delta(msg)

    async def _read(self) -> generation_pb2.GenerateResponse | None:
        msg = await self._call.read()
        return None if msg is grpc.aio.EOF else msg

    async def _first_message(self) -> generation_pb2.GenerateResponse | None:
        self._started = True
        while True:
            self._start_attempt()
            try:
                return await self._read()
            except grpc.RpcError as exc:
                wait = self._retry_wait(exc)
                if wait is None:
                    raise
                await asyncio.sleep(wait)

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cancel()


def _awaited(
    plan: Callable[P, calls.UnaryCall[T]],
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]]:
    """`AsyncClient`'s coroutine method for a unary call of `clients.calls`."""

    @method_of(plan)
    async def method(self: AsyncClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._unary(plan(*args, **kwargs))

    return method


class AsyncClient(ClientCore[AsyncGenerationStream]):
    """An asyncio client of `pagedserve.v1.TextGenerationService`; arguments as `Client`."""

    _stream_class = AsyncGenerationStream

    def _open_channel(self) -> grpc.aio.Channel:
        return self.config.aio_channel()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _unary(self, call: calls.UnaryCall[T]) -> T:
        rpc, attempts = getattr(self._stub, call.rpc), self._attempts(call)
        while True:
            try:
                reply = await rpc(call.request, timeout=attempts.deadline.remaining())
            except grpc.RpcError as exc:
                await asyncio.sleep(attempts.wait_or_raise(exc))
            else:
                return call.parse(reply)

    # `generate` (ClientCore) returns an AsyncGenerationStream: use it with `async for`.

    async def generate_text(self, prompt: str | None = None, **kwargs: Any) -> GenerationResult:
        builder = ResultBuilder()
        async with self.generate(prompt, **kwargs) as stream:
            async for delta in stream:
                builder.add(delta)
        return builder.result()

    async def chat(self, messages: Sequence[Message], **kwargs: Any) -> GenerationResult:
        return await self.generate_text(messages=messages, **kwargs)

    abort = _awaited(calls.abort)
    encode = _awaited(calls.encode)
    tokenize = _awaited(calls.tokenize)
    detokenize = _awaited(calls.detokenize)
    health = _awaited(calls.health)
    model_info = _awaited(calls.model_info)
    load_lora_adapter = _awaited(calls.load_lora_adapter)
    unload_lora_adapter = _awaited(calls.unload_lora_adapter)
    list_lora_adapters = _awaited(calls.list_lora_adapters)
