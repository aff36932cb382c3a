"""Prometheus metrics of the services, each server with its own registry and endpoint.

    tokenizer service  /metrics: pagedserve:rpc_requests_total{method,code},
                       pagedserve:tokenization_seconds, pagedserve:engine_backend_up,
                       pagedserve:engine_replica_{up,num_requests_waiting,
                       num_requests_running,kv_cache_usage_perc,num_inflight_requests}
                       {engine_address}, pagedserve:engine_failovers_total,
                       pagedserve:engine_id_retries_total,
                       pagedserve:request_migrations_total{reason},
                       pagedserve:num_inflight_requests, pagedserve:streamed_tokens_total,
                       pagedserve:streamed_text_chars_total
    engine service     /metrics: pagedserve:rpc_requests_total{method,code} and the engine's
                       own registry (`engine/observability/metrics.py`:
                       pagedserve:num_requests_running, ...)

A registry per server (not prometheus_client's global one) keeps several servers in one
process (the tests) apart. The endpoint is prometheus_client's HTTP server, in a thread.

`--metrics-name-prefix vllm` serves every name with vLLM's prefix instead (`vllm:` for
`pagedserve:`; the engine's names are vLLM's where they overlap), so dashboards, the
inference gateway's endpoint picker and autoscalers written for vLLM read them unchanged.
The names are rewritten at the endpoint only: the code and the tests use one set.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger("services.common.metrics")

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
        self.engine_messages = Counter(
            "pagedserve:engine_messages",
            "Generate messages received from the engines (several tokens each when merged).",
            registry=r,
        )
        self.streamed_text_chars = Counter(
            "pagedserve:streamed_text_chars",
            "Characters of output text streamed to clients.",
            registry=r,
        )
        self.engine_failovers = Counter(
            "pagedserve:engine_failovers",
            "Generate calls retried on another replica after failing before the first token.",
            registry=r,
        )
        self.engine_id_retries = Counter(
            "pagedserve:engine_id_retries",
            "Generate calls made again after the replica refused their request id while a "
            "call of it cancelled here was still letting go of it.",
            registry=r,
        )
        # reason: killed (the call broke), stalled (silence or a stalled step), drained
        # (the engine handed the stream back): services/tokenizer_service/replicas/migration.py
        self.request_migrations = Counter(
            "pagedserve:request_migrations",
            "Streams moved to another replica after their first token, by reason.",
            ["reason"],
            registry=r,
        )

    def attach_replicas(self, replicas: Callable[[], Iterable[Any]]) -> None:
        """Per-replica gauges, read from the pool at scrape time (so a replica that leaves
        the pool leaves the metrics): up, waiting, running, KV usage, calls in flight."""
        self.registry.register(_ReplicaCollector(replicas))


class _ReplicaCollector:
    """`pagedserve:engine_replica_*{engine_address}` from each `EngineBackend`."""

    def __init__(self, replicas: Callable[[], Iterable[Any]]) -> None:
        self._replicas = replicas

    def describe(self) -> Iterable[Any]:
        return ()  # unchecked collector: its series change with the pool

    def collect(self) -> Iterable[Any]:
        docs = {
            "up": "1 while the replica serves (the same model) and answers, else 0.",
            "num_requests_waiting": "The replica's waiting queue, as last polled.",
            "num_requests_running": "The replica's running batch, as last polled.",
            "kv_cache_usage_perc": "The replica's KV-cache usage (0 to 1), as last polled.",
            "num_inflight_requests": "This service's calls open on the replica.",
        }
        out = {
            name: GaugeMetricFamily(
                f"pagedserve:engine_replica_{name}", doc, labels=["engine_address"]
            )
            for name, doc in docs.items()
        }
        for replica in self._replicas():
            address = [replica.address]
            out["up"].add_metric(address, 1.0 if replica.available else 0.0)
            out["num_requests_waiting"].add_metric(address, replica.load.num_waiting)
            out["num_requests_running"].add_metric(address, replica.load.num_running)
            out["kv_cache_usage_perc"].add_metric(address, replica.load.kv_cache_usage)
            out["num_inflight_requests"].add_metric(address, replica.num_inflight)
        # The internal hop's messages on the replica's GenerateStream call (one per engine
        # step for all its requests; per-request calls: pagedserve:engine_messages).
        batches = CounterMetricFamily(
            "pagedserve:engine_replica_stream_batches",
            "Batches received on the replica's multiplexed GenerateStream call.",
            labels=["engine_address"],
        )
        for replica in self._replicas():
            mux = getattr(replica, "stream_mux", None)
            batches.add_metric([replica.address], mux.num_batches if mux is not None else 0)
        return [*out.values(), batches]


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


NAME_PREFIX = "pagedserve"
NAME_PREFIXES = (NAME_PREFIX, "vllm")


class _Renamed:
    """A collector serving another registry's metrics with `prefix:` for `pagedserve:`."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self._registry = registry
        self._old, self._new = f"{NAME_PREFIX}:", f"{prefix}:"

    def _name(self, name: str) -> str:
        return self._new + name[len(self._old) :] if name.startswith(self._old) else name

    def collect(self) -> Iterable[Any]:
        for family in self._registry.collect():  # fresh objects on every collect()
            family.name = self._name(family.name)
            family.samples = [s._replace(name=self._name(s.name)) for s in family.samples]
            yield family


def named_registry(registry: CollectorRegistry, prefix: str) -> CollectorRegistry:
    """`registry` as served with the name prefix `prefix` (itself for `pagedserve`)."""
    if prefix not in NAME_PREFIXES:
        raise ValueError(f"metrics name prefix must be one of {NAME_PREFIXES}, got {prefix!r}.")
    if prefix == NAME_PREFIX:
        return registry
    renamed = CollectorRegistry(auto_describe=False)
    renamed.register(_Renamed(registry, prefix))  # type: ignore[arg-type]
    return renamed


class MetricsEndpoint:
    """`/metrics` over HTTP at `address` (host:port; port 0 picks a free one), the names with
    `name_prefix` (`pagedserve` or `vllm`)."""

    def __init__(
        self, registry: CollectorRegistry, address: str, name_prefix: str = NAME_PREFIX
    ) -> None:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"metrics address must be host:port, got {address!r}.")
        self.registry = named_registry(registry, name_prefix)
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
