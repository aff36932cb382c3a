"""Prometheus metrics of one engine, named like vLLM's where they overlap (`pagedserve:`
instead of `vllm:`).

Each engine owns a `CollectorRegistry`, so several engines in one process (tests) do not
clash; a server exposes `engine.observability.metrics.registry` on its `/metrics` endpoint.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge(
            "pagedserve:num_requests_running", "Requests in the running batch."
        )
        self.num_requests_waiting = gauge(
            "pagedserve:num_requests_waiting", "Requests waiting to be scheduled."
        )
        self.kv_cache_usage = gauge(
            "pagedserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1)."
        )
        self.num_preemptions = counter(
            "pagedserve:num_preemptions", "Requests preempted (to be recomputed)."
        )
        self.prefix_cache_queries = counter(
            "pagedserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "pagedserve:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.prompt_tokens = counter("pagedserve:prompt_tokens", "Prompt tokens computed.")
        self.generation_tokens = counter("pagedserve:generation_tokens", "Tokens generated.")
        self.time_to_first_token = histogram(
            "pagedserve:time_to_first_token_seconds",
            "Arrival to first output token.",
            _LATENCY_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "pagedserve:time_per_output_token_seconds",
            "Mean time between output tokens of a request (after the first).",
            _LATENCY_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "pagedserve:e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "pagedserve:request_queue_time_seconds",
            "Arrival to first scheduling.",
            _LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "pagedserve:request_prompt_tokens",
            "Prompt length of finished requests.",
            _TOKEN_BUCKETS,
        )
        self.request_generation_tokens = histogram(
            "pagedserve:request_generation_tokens",
            "Generated length of finished requests.",
            _TOKEN_BUCKETS,
        )
        self._request_success = Counter(
            "pagedserve:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        # Per fairness key (the tenant; "" for requests that name none): what the scheduler's
        # virtual token counter charges (engine/core/fairness.py).
        self.tenant_served_tokens = Counter(
            "pagedserve:tenant_served_tokens",
            "Tokens served per fairness key (tenant): kind=prompt (computed, prefix-cache "
            "hits excluded) or output (generated).",
            ["model_name", "tenant", "kind"],
            registry=r,
        )
        self.tenant_virtual_tokens = Gauge(
            "pagedserve:tenant_virtual_tokens",
            "The fairness key's virtual token counter (weighted tokens served / weight); "
            "the backlogged key with the smallest goes next. Keys the engine forgot (idle, "
            "not ahead) have no series.",
            ["model_name", "tenant"],
            registry=r,
        )
        self._tenants_with_counter: set[str] = set()
        self.model_name = model_name

    def record_tenant_tokens(
        self, served: dict[str, tuple[int, int]], counters: dict[str, float]
    ) -> None:
        """One step's served (prompt, output) tokens per key, and every known key's
        counter (a forgotten key's series is removed)."""
        for tenant, (num_prompt, num_output) in served.items():
            if num_prompt:
                self.tenant_served_tokens.labels(self.model_name, tenant, "prompt").inc(num_prompt)
            if num_output:
                self.tenant_served_tokens.labels(self.model_name, tenant, "output").inc(num_output)
        for tenant, counter in counters.items():
            self.tenant_virtual_tokens.labels(self.model_name, tenant).set(counter)
        for tenant in self._tenants_with_counter - counters.keys():
            self.tenant_virtual_tokens.remove(self.model_name, tenant)
        self._tenants_with_counter = set(counters)

    def set_cache_config_info(self, block_size: int, num_gpu_blocks: int) -> None:
        """vLLM's `cache_config_info` info gauge (value 1, the config in labels): what the
        Kubernetes inference gateway's endpoint picker reads to size a replica's cache."""
        Gauge(
            "pagedserve:cache_config_info",
            "Information of the KV cache config (value 1).",
            ["model_name", "block_size", "num_gpu_blocks"],
            registry=self.registry,
        ).labels(self.model_name, str(block_size), str(num_gpu_blocks)).set(1)

    def record_finished(
        self,
        finish_reasons: list[str],
        num_prompt_tokens: int,
        num_generation_tokens: int,
        arrival: float,
        first_scheduled: float | None,
        first_token: float | None,
        finished: float | None,
    ) -> None:
        """One finished request (all its samples)."""
        for reason in finish_reasons:
            self._request_success.labels(self.model_name, reason).inc()
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        if first_scheduled is not None:
            self.request_queue_time.observe(first_scheduled - arrival)
        if first_token is not None:
            self.time_to_first_token.observe(first_token - arrival)
            if finished is not None and num_generation_tokens > 1:
                per_token = (finished - first_token) / (num_generation_tokens - 1)
                self.time_per_output_token.observe(per_token)
        if finished is not None:
            self.e2e_request_latency.observe(finished - arrival)
