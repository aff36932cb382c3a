"""What `Client` and `AsyncClient` share, so that each is only a transport (grpc, grpc.aio):

    ClientCore      the channel's configuration, default deadline and retry policy, the stub,
                    `generate` (a stream object of the transport's kind)
    StreamCore      one Generate call's state: its attempts, which failure ends it how, the
                    deltas it hands out, cancellation
    Attempts        one call's retry decisions: the wait after a failed attempt, or the error
    method_of       gives a transport's method the public face of a `calls` function

The transports keep only what differs: blocking or awaited reads, `time.sleep` or
`asyncio.sleep`, StopIteration or StopAsyncIteration, and asyncio's task cancellation.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Concatenate, Generic, ParamSpec, TypeVar

import grpc

from clients import calls
from clients.auth import API_KEY_ENV
from clients.channel import (
    DEFAULT_ADDRESS,
    DEFAULT_MAX_MESSAGE_BYTES,
    ChannelConfig,
    Deadline,
    Pem,
    RetryPolicy,
)
from clients.errors import from_rpc_error
from clients.outputs import GenerationDelta, delta_from_proto
from pagedserve.v1 import generation_pb2, generation_pb2_grpc

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", bound="StreamCore")

_SELF = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
_UNARY_RESULT = re.compile(r"UnaryCall\[(.*)\]")


def method_of(
    plan: Callable[P, Any], returns: str | None = None
) -> Callable[[Callable[..., R]], Callable[Concatenate[Any, P], R]]:
    """Decorates a transport's method that runs `plan`'s call: it takes the plan's name,
    docstring and signature (with `self`; returning `returns`, or what the plan's UnaryCall
    holds), so help() and IDEs show the API's arguments, not `*args, **kwargs`."""
    signature = inspect.signature(plan)
    if returns is None:
        match = _UNARY_RESULT.fullmatch(signature.return_annotation)
        assert match is not None, f"{plan.__name__} does not return a UnaryCall"
        returns = match.group(1)
    parameters = [_SELF, *signature.parameters.values()]

    def decorate(method: Callable[..., R]) -> Callable[Concatenate[Any, P], R]:
        method.__name__ = method.__qualname__ = plan.__name__
        method.__doc__ = plan.__doc__
        method.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=parameters, return_annotation=returns
        )
        return method

    return decorate


class Attempts:
    """One call's attempts, which share its deadline. After a failed one, the retry policy
    says how long to wait (UNAVAILABLE, attempts and time left) or that the call failed."""

    __slots__ = ("deadline", "num_failed", "retry")

    def __init__(self, retry: RetryPolicy, deadline: Deadline) -> None:
        self.retry = retry
        self.deadline = deadline
        self.num_failed = 0

    def wait_after(self, exc: grpc.RpcError) -> float | None:
        """Seconds to wait before the next attempt, or None when the failure is final."""
        wait = self.retry.backoff(exc.code(), self.num_failed, self.deadline)
        self.num_failed += 1
        return wait

    def wait_or_raise(self, exc: grpc.RpcError) -> float:
        """`wait_after`, raising the typed error (`clients.errors`) when the failure is final."""
        wait = self.wait_after(exc)
        if wait is None:
            raise from_rpc_error(exc) from None
        return wait


class StreamCore:
    """The state of one Generate call, read by the transport's stream. UNAVAILABLE before
    the first message is retried (`RetryPolicy`); after it, every failure is raised, so no
    text is ever replayed. A stream cancelled by its owner just ends."""

    END: ClassVar[type[Exception]]  # the exception that ends iteration in this transport

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
        self._attempts = Attempts(retry, deadline)
        self._call: Any = None
        self._started = False
        self._done = False
        self._cancelled = False

    def _start_attempt(self) -> None:
        """Opens the call (again, on a retry); one cancelled meanwhile is cancelled at once."""
        self._call = self._stub.Generate(self._request, timeout=self._attempts.deadline.remaining())
        if self._cancelled:
            self._call.cancel()

    def _retry_wait(self, exc: grpc.RpcError) -> float | None:
        """Seconds to wait before trying for the first message again, or None: it failed."""
        return None if self._cancelled else self._attempts.wait_after(exc)

    def _check_open(self) -> None:
        if self._done:
            raise self.END

    def _failed(self, exc: grpc.RpcError) -> Exception:
        """What to raise for a failed read: the end of iteration when the owner cancelled the
        stream, else the typed error."""
        self._done = True
        return self.END() if self._cancelled else from_rpc_error(exc)

    def _delta(self, msg: generation_pb2.GenerateResponse | None) -> GenerationDelta:
        """The delta for a message read; None (the stream's end) or a cancelled stream ends
        the iteration."""
        if msg is None or self._cancelled:
            self._done = True
            raise self.END
        delta = delta_from_proto(msg)
        self.request_id = delta.request_id
        return delta

    def cancel(self) -> None:
        """Cancels the call (the server aborts the request); iteration ends. Idempotent (and,
        for `Client`'s stream, safe from another thread)."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    def __del__(self) -> None:
        if self._call is not None and not self._done:
            self._call.cancel()


class ClientCore(Generic[S]):
    """A client of `pagedserve.v1.TextGenerationService` but for its transport: the channel,
    how unary calls run (`_unary`) and how the stream `S` reads. Arguments: see `Client`."""

    _stream_class: type[S]

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
        self._channel = self._open_channel()
        self._stub = generation_pb2_grpc.TextGenerationServiceStub(self._channel)

    def _open_channel(self) -> Any:
        raise NotImplementedError

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline(self.timeout if timeout is None else timeout)

    def _attempts(self, call: calls.UnaryCall[Any]) -> Attempts:
        return Attempts(call.retry or self.retry, self._deadline(call.timeout))

    @method_of(calls.generate, returns="GenerationStream | AsyncGenerationStream")
    def generate(self, *args: Any, **kwargs: Any) -> S:
        call = calls.generate(*args, **kwargs)
        deadline = self._deadline(call.timeout)
        return self._stream_class(self._stub, call.request, deadline, self.retry)
