"""`Client`: the synchronous client of pagedserve's public API, over grpc.

    with Client("localhost:50051") as client:
        for delta in client.generate("The capital of France is", max_tokens=16):
            print(delta.text, end="", flush=True)
        print(client.chat([{"role": "user", "content": "Hi!"}], temperature=0).text)

`generate` streams `GenerationDelta`s; leaving the loop early (or `stream.cancel()`, or the
end of a `with client.generate(...) as stream:` block) cancels the call, and the server
aborts the request and frees its KV cache. Failures raise `clients.errors` exceptions.

The methods, their requests and replies are `clients.calls`; the state and policies
`clients.core`. This file is the transport: blocking calls and reads, `time.sleep`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
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


class GenerationStream(StreamCore):
    """The deltas of one Generate call, as they arrive. UNAVAILABLE before the first
    message is retried (`RetryPolicy`); after it, every failure is raised."""

    END = StopIteration

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> GenerationDelta:
        self._check_open()
        try:
            msg = next(self._call, None) if self._started else self._first_message()
        except grpc.RpcError as exc:
            raise self._failed(exc) from None
        return self._delta(msg)

    def _first_message(self) -> generation_pb2.GenerateResponse | None:
        self._started = True
        while True:
            self._start_attempt()
            try:
                return next(self._call, None)
            except grpc.RpcError as exc:
                wait = self._retry_wait(exc)
                if wait is None:
                    raise
                time.sleep(wait)

    close = StreamCore.cancel

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()


def _blocking(plan: Callable[P, calls.UnaryCall[T]]) -> Callable[Concatenate[Client, P], T]:
    """`Client`'s method for a unary call of `clients.calls`."""

    @method_of(plan)
    def method(self: Client, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._unary(plan(*args, **kwargs))

    return method


class Client(ClientCore[GenerationStream]):
    """A synchronous client of `pagedserve.v1.TextGenerationService`.

    `timeout` is every call's default deadline in seconds (None: none); each method takes
    its own `timeout=`. `retry` decides how UNAVAILABLE is retried (`NO_RETRY` turns it off).
    TLS: `tls=True` (system roots) or any of `root_certificates`, `private_key`,
    `certificate_chain` (PEM bytes or file paths; the last two make it mutual TLS).
    `api_key` (default `$PAGEDSERVE_API_KEY`) goes with every call as
    `authorization: Bearer <key>`."""

    _stream_class = GenerationStream

    def _open_channel(self) -> grpc.Channel:
        return self.config.sync_channel()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _unary(self, call: calls.UnaryCall[T]) -> T:
        rpc, attempts = getattr(self._stub, call.rpc), self._attempts(call)
        while True:
            try:
                reply = rpc(call.request, timeout=attempts.deadline.remaining())
            except grpc.RpcError as exc:
                time.sleep(attempts.wait_or_raise(exc))
            else:
                return call.parse(reply)

    # `generate` (ClientCore) returns a GenerationStream.

    def generate_text(self, prompt: str | None = None, **kwargs: Any) -> GenerationResult:
        """`generate`, gathered: the whole answer, one `CompletionOutput` per index."""
        with self.generate(prompt, **kwargs) as stream:
            return ResultBuilder().add_all(stream).result()

    def chat(self, messages: Sequence[Message], **kwargs: Any) -> GenerationResult:
        """The whole answer to a conversation (`generate_text(messages=...)`)."""
        return self.generate_text(messages=messages, **kwargs)

    abort = _blocking(calls.abort)
    encode = _blocking(calls.encode)
    tokenize = _blocking(calls.tokenize)
    detokenize = _blocking(calls.detokenize)
    health = _blocking(calls.health)
    model_info = _blocking(calls.model_info)
    load_lora_adapter = _blocking(calls.load_lora_adapter)
    unload_lora_adapter = _blocking(calls.unload_lora_adapter)
    list_lora_adapters = _blocking(calls.list_lora_adapters)
