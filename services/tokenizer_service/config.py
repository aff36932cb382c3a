"""The tokenizer service's configuration: one value built by the command line (services/cli/main.py)
or by tests, read by the server and its servicer."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.grpc_server import DEFAULT_MAX_MESSAGE_BYTES
from services.security.tls import EngineLinkTLS, ServerTLSConfig
from services.tokenizer_service.request_limits import RequestLimits


@dataclass
class TokenizerServerConfig:
    address: str = "0.0.0.0:50051"
    engine_address: str = "127.0.0.1:50052"
    max_inflight_requests: int = 1024  # more → RESOURCE_EXHAUSTED
    max_prompt_tokens: int | None = None  # None: the engine's max_model_len
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    shutdown_grace_s: float = 10.0  # in-flight streams left after this are aborted
    engine_poll_interval_s: float = 1.0
    # Several engine replicas (services/tokenizer_service/replicas/pool.py): `engine_address` is a
    # comma list
    # of host:port and dns:///name:port entries; names are re-resolved this often.
    engine_dns_refresh_s: float = 5.0
    route_prefix_blocks: int = 4  # affinity key: the prompt's first (up to) N full blocks
    route_max_queue_imbalance: int = 4  # leave the affinity replica when its queue is longer
    route_policy: str = "affinity"  # or "round_robin" (a baseline: benchmarks/serving/routing.py)
    # Streams that survive their replica (services/tokenizer_service/replicas/migration.py):
    # each request moves at most this often (0: never); a replica that holds streams but has
    # sent nothing on any of them this long is stalled (0: never).
    migration_limit: int = 3
    engine_stall_timeout_s: float = 10.0
    # Every request to a replica over one GenerateStream call (replicas/stream_mux.py) where
    # the engine serves it; False: one Generate call per request (--engine-per-request-calls).
    engine_multiplex: bool = True
    # Tokens per client message while an output's tokens keep coming (SGLang's
    # --stream-interval): 1 sends each as it comes; N holds them until N have come or the
    # output ends (its first message is never held). Fewer messages, text in steps of N.
    stream_interval: int = 1
    metrics_address: str | None = None  # host:port of /metrics (port 0: a free one); None: off
    metrics_name_prefix: str = "pagedserve"  # or "vllm": vLLM's metric names on /metrics
    tls: ServerTLSConfig | None = None  # the public API's TLS / mTLS; None: plaintext
    engine_tls: EngineLinkTLS = field(default_factory=EngineLinkTLS)  # to the engine
    api_key_file: str | None = None  # None: no keys, every caller is let in
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may cost
    reuse_port: bool = False  # a worker of `--workers N`: the port is shared (SO_REUSEPORT)

    def __post_init__(self) -> None:
        if isinstance(self.stream_interval, bool) or not isinstance(self.stream_interval, int):
            raise ValueError(f"stream_interval must be an integer, got {self.stream_interval!r}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")
