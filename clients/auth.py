"""The API key on every call: `authorization: Bearer <key>` metadata, added by a channel
interceptor (call credentials would need TLS; a key over plaintext is the operator's
choice, e.g. on a trusted network or behind a TLS-terminating proxy)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

API_KEY_ENV = "PAGEDSERVE_API_KEY"


def with_key(client_call_details: Any, key: str) -> Any:
    """The call's details with the key's `authorization` entry added to its metadata."""
    metadata = [(k, v) for k, v in client_call_details.metadata or () if k != "authorization"]
    metadata.append(("authorization", f"Bearer {key}"))
    return client_call_details._replace(metadata=metadata)


class _CallDetails(grpc.ClientCallDetails):
    """A replaceable `ClientCallDetails` (grpc's own class is not a namedtuple)."""

    def __init__(self, details: Any, **changes: Any) -> None:
        for name in ("method", "timeout", "metadata", "credentials", "wait_for_ready"):
            setattr(self, name, changes.get(name, getattr(details, name, None)))
        self.compression = changes.get("compression", getattr(details, "compression", None))

    def _replace(self, **changes: Any) -> _CallDetails:
        return _CallDetails(self, **changes)


class ApiKeyInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
):
    """Sync channels (`grpc.intercept_channel`)."""

    def __init__(self, key: str) -> None:
        self._key = key

    def _details(self, details: Any) -> Any:
        return with_key(_CallDetails(details), self._key)

    def intercept_unary_unary(self, continuation: Callable, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)


class _AioApiKey:
    def __init__(self, key: str) -> None:
        self._key = key

    def _details(self, details: Any) -> Any:
        return with_key(_CallDetails(details), self._key)


class AioUnaryUnaryApiKey(_AioApiKey, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Callable, client_call_details: Any, request: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request)


class AioUnaryStreamApiKey(_AioApiKey, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Callable, client_call_details: Any, request: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request)


def aio_interceptors(key: str) -> list[grpc.aio.ClientInterceptor]:
    return [AioUnaryUnaryApiKey(key), AioUnaryStreamApiKey(key)]
