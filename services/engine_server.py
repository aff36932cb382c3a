"""The engine service: `pagedserve.v1.EngineService` over one `AsyncLLMEngine`.

Token ids in, token-id deltas out; it never sees text (the engine runs with
`skip_tokenizer_init=True`). One stream per request:

    EngineGenerateRequest ──▶ engine.generate(..., output_kind=DELTA, detokenize=False)
    EngineGenerateResponse ◀── one message per changed output index per engine step

The same port serves vLLM's engine protocol, `vllm.grpc.engine.VllmEngine`
(`services/vllm_servicer.py`), for gateways such as smg and llm-d; both APIs share the
engine, the in-flight request table, health and reflection.

When the client cancels (or its deadline passes) gRPC cancels the handler; closing the
engine's generator then aborts the request, which frees its KV blocks at once.

Observability (docs/observability.md): each RPC has a SERVER span (`rpc_method`), which is
the parent passed to the engine as the request's trace headers, so the engine's
`llm_request` span is its child; `/metrics` (`metrics_address`) serves the RPC counts and
the engine's own registry; the engine's stats line is logged every `log_stats_interval_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import trace
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

from engine import (
    AsyncLLMEngine,
    EngineConfig,
    EngineDeadError,
    RequestOutputKind,
)
from pagedserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services import convert, tracing
from services.engine_admin import EngineAdminRpcs
from services.engine_lora import EngineLoraRpcs
from services.errors import ConfigError, ServiceError, invalid_argument, rpc_method
from services.grpc_server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ENGINE_SERVICE,
    HealthReporter,
    bind,
    create_server,
    enable_reflection,
    trace_headers,
)
from services.limits import RequestRegistry
from services.metrics import EngineServiceMetrics, MetricsEndpoint
from services.tls import ServerTLS, ServerTLSConfig, is_loopback
from services.vllm_servicer import VLLM_ENGINE_SERVICE, VllmEngineServicer
from services.wire import WireGuard

logger = logging.getLogger("services.engine")

_ENGINE_WATCH_INTERVAL_S = 0.5


@dataclass
class EngineServerConfig:
    address: str = "127.0.0.1:50052"
    max_inflight_requests: int = 1024  # more → RESOURCE_EXHAUSTED
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    shutdown_grace_s: float = 10.0  # in-flight streams left after this are aborted
    metrics_address: str | None = None  # host:port of /metrics (port 0: a free one); None: off
    metrics_name_prefix: str = "pagedserve"  # or "vllm": vLLM's metric names on /metrics
    log_stats_interval_s: float = 10.0  # the engine's stats line every so often; 0: never
    tls: ServerTLSConfig | None = None  # None: plaintext (loopback only, or allow_insecure)
    allow_insecure: bool = False  # plaintext on a non-loopback address (--allow-insecure-engine)


def model_info_from_config(config: EngineConfig) -> common_pb2.ModelInfo:
    model, cache, hf = config.model_config, config.cache_config, config.model_config.hf_config
    return common_pb2.ModelInfo(
        model=model.model or "",  # empty: the default model
        architecture=(getattr(hf, "architectures", None) or [""])[0],
        vocab_size=model.vocab_size,
        max_model_len=model.max_model_len,
        eos_token_ids=sorted(model.eos_token_ids),
        dtype=model.dtype,
        device=config.device_config.device,
        block_size=cache.block_size,
        num_kv_blocks=cache.num_blocks,
        hidden_size=int(hf.hidden_size),
        effective_max_model_len=min(model.max_model_len, cache.num_blocks * cache.block_size),
        max_logprobs=model.max_logprobs,
    )


class EngineServicer(EngineAdminRpcs, EngineLoraRpcs, engine_pb2_grpc.EngineServiceServicer):
    """Thin: proto → engine call → proto; errors become statuses in `services.errors`."""

    SERVICE_NAME = ENGINE_SERVICE

    def __init__(
        self,
        health: HealthReporter,
        max_inflight_requests: int,
        rpc_metrics: EngineServiceMetrics | None = None,
    ) -> None:
        self.health = health
        self.engine: AsyncLLMEngine | None = None
        self.model_info = common_pb2.ModelInfo()
        self.model_name = ""  # in spans: the engine's served model name
        self.requests: RequestRegistry[None] = RequestRegistry(max_inflight_requests)
        self.rpc_metrics = rpc_metrics

    def _ready_engine(self) -> AsyncLLMEngine:
        if self.engine is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the engine is still loading")
        return self.engine

    @rpc_method
    async def Generate(self, request: engine_pb2.EngineGenerateRequest, context: Any) -> None:
        span = trace.get_current_span()  # this call's (rpc_method): llm_request's parent
        engine = self._ready_engine()
        request_id = _check_request_id(request.request_id)
        params = convert.sampling_params_from_proto(
            request.sampling_params, output_kind=RequestOutputKind.DELTA, detokenize=False
        )
        lora_request = self.lora_request_for(request.lora_name)
        tracing.set_request_attributes(span, request_id, self.model_name, params)
        if lora_request is not None:
            span.set_attribute("gen_ai.request.lora_name", lora_request.lora_name)
        builder = convert.EngineResponseBuilder(request_id, params)
        start = time.perf_counter()
        with self.requests.admit(request_id, None):
            stream = engine.generate(
                convert.token_ids_prompt(request.prompt_token_ids, request.cache_salt),
                params,
                request_id,
                trace_headers=_engine_trace_headers(request, context),
                priority=request.priority,
                lora_request=lora_request,
            )
            async with contextlib.aclosing(stream):
                async for output in stream:
                    for response in builder.build(output):
                        await context.write(response)
        finish_reasons = [r for _, r in sorted(builder.finish_reasons.items())]
        num_completion_tokens = sum(builder.num_completion_tokens.values())
        tracing.set_usage_attributes(
            span, len(request.prompt_token_ids), num_completion_tokens, finish_reasons
        )
        logger.info(
            "request finished",
            extra={
                "request_id": request_id,
                "prompt_tokens": len(request.prompt_token_ids),
                "completion_tokens": num_completion_tokens,
                "finish_reasons": ",".join(finish_reasons),
                "seconds": round(time.perf_counter() - start, 3),
            },
        )

    @rpc_method
    async def Encode(
        self, request: engine_pb2.EngineEncodeRequest, context: Any
    ) -> engine_pb2.EngineEncodeResponse:
        engine = self._ready_engine()
        request_id = _check_request_id(request.request_id)
        params = convert.pooling_params_from_proto(request.pooling_params)
        lora_request = self.lora_request_for(request.lora_name)
        final = None
        with self.requests.admit(request_id, None):
            stream = engine.encode(
                convert.token_ids_prompt(request.prompt_token_ids, request.cache_salt),
                params,
                request_id,
                trace_headers=_engine_trace_headers(request, context),
                priority=request.priority,
                lora_request=lora_request,
            )
            async with contextlib.aclosing(stream):
                async for output in stream:
                    final = output
        if final is None:
            raise ServiceError(grpc.StatusCode.ABORTED, f"request {request_id!r} was aborted")
        return engine_pb2.EngineEncodeResponse(
            request_id=request_id,
            embedding=final.outputs.data.tolist(),
            usage=common_pb2.Usage(
                prompt_tokens=len(final.prompt_token_ids), cached_tokens=final.num_cached_tokens
            ),
        )

    @rpc_method
    async def Abort(self, request: common_pb2.AbortRequest, context: Any) -> Any:
        tracing.set_abort_attributes(trace.get_current_span(), request.request_ids)
        live = [rid for rid in dict.fromkeys(request.request_ids) if rid in self.requests]
        if live:
            await self._ready_engine().abort(live)
            logger.info("aborted", extra={"request_ids": ",".join(live)})
        return common_pb2.AbortResponse(aborted_request_ids=live)

    @rpc_method
    async def Health(self, request: common_pb2.HealthRequest, context: Any) -> Any:
        details = {"num_inflight_streams": str(len(self.requests))}
        if self.engine is None:
            return common_pb2.HealthResponse(healthy=False, status="NOT_SERVING", details=details)
        try:
            await self.engine.check_health()
            healthy = True
        except EngineDeadError as exc:
            healthy, details["error"] = False, str(exc)
        stats = self.engine.get_stats()
        details.update(
            model=self.model_info.model,
            num_running_requests=str(stats.num_running),
            num_waiting_requests=str(stats.num_waiting),
            num_engine_requests=str(stats.num_requests),
            num_kv_blocks=str(stats.num_total_blocks),
            num_free_kv_blocks=str(stats.num_free_blocks),
            kv_cache_usage=f"{stats.kv_cache_usage:.4f}",
            num_preemptions_total=str(stats.num_preemptions_total),
            is_sleeping=str(stats.is_sleeping).lower(),  # asleep: requests wait for WakeUp
        )
        parallel = self.engine.engine.get_parallel_config()
        details.update(
            tensor_parallel_size=str(parallel.tensor_parallel_size),
            pipeline_parallel_size=str(parallel.pipeline_parallel_size),
        )
        healthy = healthy and self.health.serving
        status = "SERVING" if healthy else "NOT_SERVING"
        return common_pb2.HealthResponse(healthy=healthy, status=status, details=details)

    @rpc_method
    async def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: Any
    ) -> common_pb2.ModelInfo:
        self._ready_engine()
        return self.model_info


def _engine_trace_headers(request: Any, context: Any) -> dict[str, str] | None:
    """The request's trace headers for the engine, with this call's span as the parent."""
    incoming = trace_headers(request.trace_headers, context)
    return tracing.outgoing_trace_headers(incoming) or None


def _check_request_id(request_id: str) -> str:
    if not request_id:
        raise invalid_argument("request_id must not be empty")
    return request_id


def _check_transport(config: EngineServerConfig) -> None:
    """The engine API carries every prompt's token ids and takes no API keys: off this
    machine it needs TLS (better mTLS), unless the operator says otherwise."""
    if config.tls is not None or is_loopback(config.address):
        return
    if not config.allow_insecure:
        raise ConfigError(
            f"the engine API would listen on {config.address} without TLS: give "
            "--tls-cert-file/--tls-key-file (and --tls-client-ca-file), bind a loopback "
            "address, or pass --allow-insecure-engine"
        )
    logger.warning(
        "engine API listening without TLS on a non-loopback address (--allow-insecure-engine)",
        extra={"address": config.address},
    )


class EngineServer:
    """One gRPC server for one engine. `start()` answers health (NOT_SERVING) at once;
    `attach_engine()` makes it serve, so a model can load while probes get answers."""

    def __init__(self, config: EngineServerConfig) -> None:
        self.config = config
        self.tls = ServerTLS(config.tls) if config.tls is not None else None
        _check_transport(config)
        self.server = create_server(config.max_message_bytes, [WireGuard()])
        services = [ENGINE_SERVICE, VLLM_ENGINE_SERVICE]
        self.health = HealthReporter(self.server, services)
        self.metrics = EngineServiceMetrics()
        self.servicer = EngineServicer(self.health, config.max_inflight_requests, self.metrics)
        engine_pb2_grpc.add_EngineServiceServicer_to_server(self.servicer, self.server)
        # vLLM's engine protocol on the same port, sharing the in-flight request table.
        self.vllm_servicer = VllmEngineServicer(self.servicer.requests, self.metrics)
        vllm_pb2_grpc.add_VllmEngineServicer_to_server(self.vllm_servicer, self.server)
        enable_reflection(self.server, services)
        self.port = 0
        self.metrics_endpoint: MetricsEndpoint | None = None
        if config.metrics_address is not None:
            self.metrics_endpoint = MetricsEndpoint(
                self.metrics.registry, config.metrics_address, config.metrics_name_prefix
            )
        self.engine_dead = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def engine(self) -> AsyncLLMEngine | None:
        return self.servicer.engine

    async def start(self) -> int:
        """Starts listening; returns the bound port."""
        credentials = self.tls.credentials() if self.tls is not None else None
        self.port = bind(self.server, self.config.address, credentials)
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.start()
        await self.health.set_serving(False, "loading")
        await self.server.start()
        logger.info(
            "engine service listening",
            extra={
                "address": self.config.address,
                "port": self.port,
                "tls": "mtls" if self.tls and self.tls.mutual else "tls" if self.tls else "off",
            },
        )
        return self.port

    def reload(self) -> None:
        """SIGHUP: the TLS certificate again (live streams keep going)."""
        if self.tls is not None:
            self.tls.reload()

    async def attach_engine(self, engine: AsyncLLMEngine) -> None:
        config = await engine.get_engine_config()
        self.servicer.model_info = model_info_from_config(config)
        self.servicer.model_name = config.model_config.served_model_name
        self.servicer.engine = engine
        self.vllm_servicer.attach(engine, config)
        self.metrics.attach_engine(engine.metrics_registry)
        await self.health.set_serving(not engine.errored, "engine ready")
        self._tasks.append(asyncio.create_task(self._watch_engine(engine)))
        if self.config.log_stats_interval_s > 0:
            interval = self.config.log_stats_interval_s
            self._tasks.append(asyncio.create_task(self._log_stats_every(engine, interval)))

    async def _watch_engine(self, engine: AsyncLLMEngine) -> None:
        """A dead engine turns health NOT_SERVING (the process should be restarted)."""
        while not engine.errored:
            await asyncio.sleep(_ENGINE_WATCH_INTERVAL_S)
        await self.health.set_serving(False, f"engine dead: {engine.dead_error}")
        self.engine_dead.set()

    async def _log_stats_every(self, engine: AsyncLLMEngine, interval: float) -> None:
        """The engine's stats line (throughput, running / waiting, KV-cache use) every
        `interval` seconds (repeated idle lines at DEBUG level)."""
        while not engine.errored:
            await asyncio.sleep(interval)
            with contextlib.suppress(EngineDeadError):
                await engine.do_log_stats()

    async def stop(self, grace: float | None = None) -> None:
        """Stops taking requests; in-flight streams get `grace` seconds to finish, then
        the engine aborts them (their streams end with finish_reason ABORT)."""
        grace = self.config.shutdown_grace_s if grace is None else grace
        await self.health.shutdown()
        aborter = asyncio.create_task(self._abort_all_after(grace * 0.8))
        try:
            await self.server.stop(grace)
        finally:
            aborter.cancel()
            for task in self._tasks:
                task.cancel()
            if self.metrics_endpoint is not None:
                await self.metrics_endpoint.stop()
        logger.info("engine service stopped", extra={"port": self.port})

    async def _abort_all_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        live = [rid for rid, _ in self.servicer.requests.items()]
        if live and self.engine is not None:
            logger.info("shutdown: aborting in-flight requests", extra={"count": len(live)})
            await self.engine.abort(live)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()
