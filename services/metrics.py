"""Prometheus metrics of the services, each server with its own registry and endpoint.

    tokenizer service  /metrics: pagedserve:rpc_requests_total{method,code},
                       pagedserve:tokenization_seconds, pagedserve:engine_backend_up,
                       pagedserve:num_inflight_requests, pagedserve:streamed_tokens_total,
                       pagedserve:streamed_text_chars_total
    engine service     /metrics: pagedserve:rpc_requests_total{method,code} and the engine's
                       own registry (`engine/metrics.py`: pagedserve:num_requests_running, ...)

A registry per server (not prometheus_client's global one) keeps several servers in one
process (the tests) apart. The endpoint is prometheus_client's HTTP server, in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

logger = logging.getLogger("services.metrics")

_TOKENIZATION_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


class RpcMetrics:
    """What both servers count: RPCs by method and status code."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rpc_requests = Counter(
            "pagedserve:rpc_requests",
            "RPCs handled, by method and final status code.",
            ["method", "code"],
            registry=self.registry,
        )

    def count_rpc(self, method: str, code: grpc.StatusCode) -> None:
        self.rpc_requests.labels(method, code.name).inc()


class TokenizerMetrics(RpcMetrics):
    def __init__(self, num_inflight: Callable[[], int]) -> None:
        super().__init__()
        r = self.registry
        self.tokenization_seconds = Histogram(
            "pagedserve:tokenization_seconds",
            "Time to check, template and tokenize a request's prompt.",
            buckets=_TOKENIZATION_BUCKETS,
            registry=r,
        )
        self.engine_backend_up = Gauge(
            "pagedserve:engine_backend_up",
            "1 while the engine service answers, else 0.",
            registry=r,
        )
        self.num_inflight_requests = Gauge(
            "pagedserve:num_inflight_requests", "Generate and Encode calls in flight.", registry=r
        )
        self.num_inflight_requests.set_function(num_inflight)
        self.streamed_tokens = Counter(
            "pagedserve:streamed_tokens", "Output tokens streamed to clients.", registry=r
        )
        self.streamed_text_chars = Counter(
            "pagedserve:streamed_text_chars",
            "Characters of output text streamed to clients.",
            registry=r,
        )


class EngineServiceMetrics(RpcMetrics):
    """RPC counts, plus the engine's registry once the engine is attached (the endpoint
    answers while the model loads)."""

    def __init__(self) -> None:
        super().__init__()
        self._engine_registry: CollectorRegistry | None = None
        self.registry.register(self)  # collect() below forwards to the engine's registry

    def attach_engine(self, registry: CollectorRegistry) -> None:
        self._engine_registry = registry

    def collect(self) -> Iterable[Any]:
        registry = self._engine_registry
        return registry.collect() if registry is not None else ()


class MetricsEndpoint:
    """`/metrics` over HTTP at `address` (host:port; port 0 picks a free one)."""

    def __init__(self, registry: CollectorRegistry, address: str) -> None:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"metrics address must be host:port, got {address!r}.")
        self.registry = registry
        self.host = host.strip("[]") or "0.0.0.0"
        self.requested_port = int(port)
        self.port = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Starts serving; returns the bound port."""
        try:
            self._server, self._thread = start_http_server(
                self.requested_port, self.host, registry=self.registry
            )
        except OSError as exc:
            where = f"{self.host}:{self.requested_port}"
            raise OSError(f"cannot serve metrics on {where}: {exc}") from exc
        self.port = self._server.server_port
        logger.info("metrics endpoint listening", extra={"host": self.host, "port": self.port})
        return self.port

    async def stop(self) -> None:
        if self._server is None:
            return
        server, self._server = self._server, None
        # shutdown() waits for the serving loop's next poll (up to 0.5 s): not on the loop.
        await asyncio.to_thread(server.shutdown)
        server.server_close()
