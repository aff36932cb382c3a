"""`AsyncClient`: the asyncio client of pagedserve's public API (the same methods as
`Client`, awaited).

    async with AsyncClient("localhost:50051") as client:
        async for delta in client.generate("The capital of France is", max_tokens=16):
            print(delta.text, end="", flush=True)

Leaving `async for` early, `await stream.aclose()` / `stream.cancel()`, or the end of an
`async with client.generate(...) as stream:` block cancels the call; the server aborts the
request. A channel belongs to the event loop it was made on: make the client in a coroutine.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from clients import requests
from clients.auth import API_KEY_ENV
from clients.channel import (
    DEFAULT_ADDRESS,
    DEFAULT_MAX_MESSAGE_BYTES,
    NO_RETRY,
    ChannelConfig,
    Deadline,
    Pem,
    RetryPolicy,
)
from clients.errors import from_rpc_error
from clients.outputs import (
    GenerationDelta,
    GenerationResult,
    HealthStatus,
    LoraAdapter,
    ModelInfo,
    ResultBuilder,
    TokenizeResult,
    delta_from_proto,
    health_from_proto,
    lora_adapters_from_proto,
    model_info_from_proto,
    tokenize_from_proto,
)
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from clients.requests import Message, SamplingKwargs


def _task_cancelling() -> bool:
    """Whether the current task is being cancelled (Python >= 3.11 can tell)."""
    task = asyncio.current_task()
    return task is not None and getattr(task, "cancelling", lambda: 0)() > 0


class AsyncGenerationStream:
    """The deltas of one Generate call, as they arrive (`async for`). UNAVAILABLE before
    the first message is retried (`RetryPolicy`); after it, every failure is raised."""

    def __init__(
        self,
        stub: generation_pb2_grpc.TextGenerationServiceStub,
        request: generation_pb2.GenerateRequest,
        deadline: Deadline,
        retry: RetryPolicy,
    ) -> None:
        self.request_id = request.request_id  # the server's id once the first delta is in
        self._stub = stub
        self._request = request
        self._deadline = deadline
        self._retry = retry
        self._call: Any = None
        self._started = False
        self._done = False
        self._cancelled = False

    def __aiter__(self) -> AsyncGenerationStream:
        return self

    async def __anext__(self) -> GenerationDelta:
        if self._done:
            raise StopAsyncIteration
        try:
            if self._started:
                msg = await self._call.read()
            else:
                self._started = True
                msg = await self._first_message()
        except grpc.RpcError as exc:
            self._done = True
            if self._cancelled:
                raise StopAsyncIteration from None
            raise from_rpc_error(exc) from None
        except asyncio.CancelledError:
            self._done = True
            if self._cancelled and not _task_cancelling():
                raise StopAsyncIteration from None  # cancelled by its owner: just ends
            raise
        if msg is grpc.aio.EOF or self._cancelled:
            self._done = True
            raise StopAsyncIteration
        delta = delta_from_proto(msg)
        self.request_id = delta.request_id
        return delta

    async def _first_message(self) -> Any:
        for attempt in itertools.count():
            self._call = self._stub.Generate(self._request, timeout=self._deadline.remaining())
            if self._cancelled:
                self._call.cancel()
            try:
                return await self._call.read()
            except grpc.RpcError as exc:
                wait = (
                    None
                    if self._cancelled
                    else self._retry.backoff(exc.code(), attempt, self._deadline)
                )
                if wait is None:
                    raise
                await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    def cancel(self) -> None:
        """Cancels the call (the server aborts the request); iteration ends. Idempotent."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        if self._call is not None and not self._done:
            self._call.cancel()


class AsyncClient:
    """An asyncio client of `pagedserve.v1.TextGenerationService`; arguments as `Client`."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        tls: bool = False,
        root_certificates: Pem | None = None,
        private_key: Pem | None = None,
        certificate_chain: Pem | None = None,
        api_key: str | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.config = ChannelConfig(
            address=address,
            tls=tls,
            root_certificates=root_certificates,
            private_key=private_key,
            certificate_chain=certificate_chain,
            api_key=api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None,
            max_message_bytes=max_message_bytes,
            options=tuple(options),
        )
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._channel = self.config.aio_channel()
        self._stub = generation_pb2_grpc.TextGenerationServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline(self.timeout if timeout is None else timeout)

    async def _unary(
        self,
        method: Callable[..., Any],
        request: Any,
        timeout: float | None,
        retry: RetryPolicy | None = None,
    ) -> Any:
        deadline, retry = self._deadline(timeout), retry or self.retry
        for attempt in itertools.count():
            try:
                return await method(request, timeout=deadline.remaining())
            except grpc.RpcError as exc:
                wait = retry.backoff(exc.code(), attempt, deadline)
                if wait is None:
                    raise from_rpc_error(exc) from None
                await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    # ---- generation -------------------------------------------------------------------

    def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[Message] | None = None,
        request_id: str = "",
        priority: int = 0,
        trace_headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool | None = None,
        lora_name: str = "",
        **sampling: Unpack[SamplingKwargs],
    ) -> AsyncGenerationStream:
        """Streams the answer to one prompt (see `Client.generate`); use with `async for`."""
        request = requests.generate_request(
            prompt,
            token_ids,
            messages,
            request_id=request_id,
            priority=priority,
            trace_headers=trace_headers,
            add_special_tokens=add_special_tokens,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            lora_name=lora_name,
            **sampling,
        )
        return AsyncGenerationStream(self._stub, request, self._deadline(timeout), self.retry)

    async def generate_text(self, prompt: str | None = None, **kwargs: Any) -> GenerationResult:
        builder = ResultBuilder()
        async with self.generate(prompt, **kwargs) as stream:
            async for delta in stream:
                builder.add(delta)
        return builder.result()

    async def chat(self, messages: Sequence[Message], **kwargs: Any) -> GenerationResult:
        return await self.generate_text(messages=messages, **kwargs)

    async def abort(
        self, request_ids: str | Iterable[str], *, timeout: float | None = None
    ) -> list[str]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        request = common_pb2.AbortRequest(request_ids=ids)
        reply = await self._unary(self._stub.Abort, request, timeout)
        return list(reply.aborted_request_ids)

    # ---- embeddings, text, health -----------------------------------------------------

    async def encode(
        self,
        texts: str | Sequence[str] | None = None,
        *,
        token_ids: Sequence[Sequence[int]] | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        request_id: str = "",
        trace_headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        lora_name: str = "",
    ) -> list[list[float]]:
        request = requests.encode_request(
            texts,
            token_ids,
            normalize=normalize,
            dimensions=dimensions,
            request_id=request_id,
            trace_headers=trace_headers,
            lora_name=lora_name,
        )
        reply = await self._unary(self._stub.Encode, request, timeout)
        return [list(e.values) for e in reply.embeddings]

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
    ) -> TokenizeResult:
        request = requests.tokenize_request(text, messages, add_special_tokens=add_special_tokens)
        return tokenize_from_proto(await self._unary(self._stub.Tokenize, request, timeout))

    async def detokenize(
        self,
        token_ids: Sequence[int],
        *,
        skip_special_tokens: bool | None = None,
        timeout: float | None = None,
    ) -> str:
        request = generation_pb2.DetokenizeRequest(
            token_ids=token_ids, skip_special_tokens=skip_special_tokens
        )
        return (await self._unary(self._stub.Detokenize, request, timeout)).text

    async def health(self, *, timeout: float | None = None) -> HealthStatus:
        request = common_pb2.HealthRequest()
        reply = await self._unary(self._stub.Health, request, timeout, NO_RETRY)
        return health_from_proto(reply)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        request = common_pb2.GetModelInfoRequest()
        return model_info_from_proto(await self._unary(self._stub.GetModelInfo, request, timeout))

    # ---- LoRA adapters (admin RPCs: an admin key when the server has API keys) ---------

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, *, timeout: float | None = None
    ) -> int:
        """Loads a PEFT adapter directory (a path on the engines' hosts) on every engine
        replica under `lora_name`; returns its id. Not retried: a retry could find it
        loaded."""
        request = common_pb2.LoadLoraAdapterRequest(lora_name=lora_name, lora_path=lora_path)
        reply = await self._unary(self._stub.LoadLoraAdapter, request, timeout, NO_RETRY)
        return reply.lora_int_id

    async def unload_lora_adapter(self, lora_name: str, *, timeout: float | None = None) -> None:
        request = common_pb2.UnloadLoraAdapterRequest(lora_name=lora_name)
        await self._unary(self._stub.UnloadLoraAdapter, request, timeout, NO_RETRY)

    async def list_lora_adapters(self, *, timeout: float | None = None) -> list[LoraAdapter]:
        request = common_pb2.ListLoraAdaptersRequest()
        reply = await self._unary(self._stub.ListLoraAdapters, request, timeout)
        return lora_adapters_from_proto(reply)
