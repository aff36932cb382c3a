"""`TenantGuard`: API keys, admin RPCs and per-tenant limits on the public API.

With keys configured (`services.security.auth.ApiKeys`), every RPC except the standard health
service and reflection needs `authorization: Bearer <key>` metadata:

    no key, or a key that is not configured   UNAUTHENTICATED (one message for both)
    a non-admin key calling an admin RPC      PERMISSION_DENIED
    over the tenant's rps / max_streams       RESOURCE_EXHAUSTED + `retry-after-ms` trailer

Admin RPCs: `TextGenerationService/Health` (it shows the deployment: the engine's address
and its whole KV cache and queue, i.e. every tenant's load) and the LoRA adapter RPCs
`LoadLoraAdapter` / `UnloadLoraAdapter` / `ListLoraAdapters` (they change or show what every
engine replica serves, for all tenants, and name paths on the engines' hosts). Everything
else is open to every tenant, with request ids scoped to the tenant
(`services.security.auth.scoped_request_id`).

An accepted call runs with `services.security.auth.current_principal` set, so the servicer, its span
(`pagedserve.tenant`) and the logs know the tenant; the key itself goes nowhere.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter

from services.common.grpc_server import TEXT_GENERATION_SERVICE
from services.common.limits import RateLimited, TenantLimits
from services.security.auth import ApiKeys
from services.security.caller import Principal, current_principal

logger = logging.getLogger("services.security.tenancy")

OPEN_SERVICES = frozenset(
    {health.SERVICE_NAME, reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection"}
)
ADMIN_METHODS = frozenset(
    f"/{TEXT_GENERATION_SERVICE}/{name}"
    for name in ("Health", "LoadLoraAdapter", "UnloadLoraAdapter", "ListLoraAdapters")
)
STREAM_METHODS = frozenset(
    {f"/{TEXT_GENERATION_SERVICE}/Generate", f"/{TEXT_GENERATION_SERVICE}/Encode"}
)
UNAUTHENTICATED_MESSAGE = "missing or unknown API key: send metadata 'authorization: Bearer <key>'"
RETRY_AFTER_KEY = "retry-after-ms"


class TenantMetrics:
    """Requests and rejections by tenant (the tenant's name, never its key)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "pagedserve:tenant_requests",
            "Authenticated RPCs admitted, by tenant and method.",
            ["tenant", "method"],
            registry=registry,
        )
        self.rejected = Counter(
            "pagedserve:tenant_rejected_requests",
            "RPCs refused before they ran, by tenant ('' when unknown) and reason.",
            ["tenant", "reason"],
            registry=registry,
        )


def bearer_key(metadata: Any) -> str | None:
    """The key of the one `authorization: Bearer <key>` entry, else None."""
    values = [v for k, v in metadata or () if k == "authorization"]
    if len(values) != 1:
        return None
    value = values[0] if isinstance(values[0], str) else values[0].decode("latin-1")
    scheme, _, key = value.strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


class TenantGuard(grpc.aio.ServerInterceptor):
    """The first interceptor of the public server (before `services.common.wire.WireGuard`, so a
    caller without a key does not even get its bytes parsed)."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys
        self.limits = TenantLimits()
        self.metrics: TenantMetrics | None = None

    def attach_metrics(self, registry: CollectorRegistry) -> None:
        self.metrics = TenantMetrics(registry)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.split("/")[1] in OPEN_SERVICES:
            return handler
        key = bearer_key(handler_call_details.invocation_metadata)
        principal = self.keys.authenticate(key) if key is not None else None
        return _wrap(handler, lambda context: self.guarding(principal, method, context))

    def _count(self, tenant: str, reason: str | None, method: str) -> None:
        if self.metrics is None:
            return
        if reason is None:
            self.metrics.requests.labels(tenant, method.rpartition("/")[2]).inc()
        else:
            self.metrics.rejected.labels(tenant, reason).inc()

    async def _admit(
        self, principal: Principal | None, method: str, context: grpc.aio.ServicerContext
    ) -> Principal:
        """The caller, or the call ends here with its status."""
        if principal is None:
            self._count("", "unauthenticated", method)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        assert principal is not None
        tenant = principal.tenant
        if method in ADMIN_METHODS and not principal.admin:
            self._count(tenant.name, "permission_denied", method)
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method.rpartition('/')[2]} needs an admin key (tenant {tenant.name!r})",
            )
        try:
            self.limits.check_rate(tenant.name, tenant.rps)
        except RateLimited as exc:
            self._count(tenant.name, "rps", method)
            await _abort_limited(context, exc)
        return principal

    @contextlib.asynccontextmanager
    async def guarding(
        self, principal: Principal | None, method: str, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[None]:
        """Admits the call (or ends it with its status) and runs the block as the caller,
        holding one of its streams for Generate / Encode."""
        principal = await self._admit(principal, method, context)
        tenant = principal.tenant
        max_streams = tenant.max_streams if method in STREAM_METHODS else None
        try:
            self.limits.acquire_stream(tenant.name, max_streams)
        except RateLimited as exc:
            self._count(tenant.name, "max_streams", method)
            await _abort_limited(context, exc)
        self._count(tenant.name, None, method)
        token = current_principal.set(principal)
        try:
            yield
        finally:
            current_principal.reset(token)
            self.limits.release_stream(tenant.name)


async def _abort_limited(context: grpc.aio.ServicerContext, exc: RateLimited) -> None:
    await context.abort(
        exc.code, exc.message, trailing_metadata=((RETRY_AFTER_KEY, str(exc.retry_after_ms)),)
    )


Guard = Callable[[grpc.aio.ServicerContext], contextlib.AbstractAsyncContextManager[None]]


def _wrap(handler: grpc.RpcMethodHandler, guard: Guard) -> grpc.RpcMethodHandler:
    """The same handler kind, its behaviour run inside `guard(context)`."""

    def guarded(behaviour: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behaviour):

            async def generate(request: Any, context: Any) -> AsyncIterator[Any]:
                async with guard(context):
                    async for response in behaviour(request, context):
                        yield response

            return generate

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with guard(context):
                result = behaviour(request, context)
                return await result if inspect.isawaitable(result) else result

        return call

    kind = {
        (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
        (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
        (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
        (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
    }[(bool(handler.request_streaming), bool(handler.response_streaming))]
    attribute, make = kind
    return make(
        guarded(getattr(handler, attribute)),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
