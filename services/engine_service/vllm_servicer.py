"""vLLM's engine protocol, `vllm.grpc.engine.VllmEngine`, on the engine service's port.

The contract the ecosystem's gateways use to reach engines (smg, llm-d's router, the
Kubernetes inference gateway's gRPC support). Its message classes come from the
`smg-grpc-proto` package; the servicer is thin, like `EngineServicer` beside it:

    GenerateRequest ─▶ vllm_convert (checks, SamplingParams) ─▶ engine.generate
    GenerateResponse ◀─ chunk per delta (stream=true) / one complete per output index

Cancelling the call (the gateway's client went away) closes the engine's generator, which
aborts the request and frees its KV blocks, as on our own API. `SubscribeKvEvents` streams
the block pool's prefix-cache events (engine/core/kv_events.py) with the KV-cache manager's
own chained block hashes, so a cache-aware router knows exactly which prefixes are cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import io
import json
import time
import zipfile
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

from engine import AsyncLLMEngine, EngineConfig, EngineDeadError, PoolingParams
from services.common import tracing
from services.common.errors import ServiceError, rpc_method
from services.common.grpc_server import trace_headers
from services.common.limits import RequestRegistry
from services.engine_service import convert, vllm_convert

VLLM_ENGINE_SERVICE = vllm_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
)
_TOKENIZER_CHUNK_BYTES = 64 * 1024


class VllmEngineServicer(vllm_pb2_grpc.VllmEngineServicer):
    """Shares the engine and the in-flight request table with `EngineServicer` (so request
    ids are unique across both APIs, and shutdown aborts both kinds)."""

    SERVICE_NAME = VLLM_ENGINE_SERVICE

    def __init__(self, requests: RequestRegistry[None], rpc_metrics: Any = None) -> None:
        self.engine: AsyncLLMEngine | None = None
        self.config: EngineConfig | None = None
        self.requests = requests
        self.rpc_metrics = rpc_metrics
        self.started_at = time.time()
        self.last_receive_timestamp = 0.0
        # The engine service's health (draining, a stalled step); set by EngineServer.
        self.health: Any = None

    def attach(self, engine: AsyncLLMEngine, config: EngineConfig) -> None:
        self.engine, self.config = engine, config

    def _ready(self) -> tuple[AsyncLLMEngine, EngineConfig]:
        if self.engine is None or self.config is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the engine is still loading")
        if self.health is not None and self.health.shutting_down:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the engine service is draining")
        return self.engine, self.config

    # ---- requests ---------------------------------------------------------------------

    @rpc_method
    async def Generate(self, request: vllm_pb2.GenerateRequest, context: Any) -> None:
        engine, config = self._ready()
        self.last_receive_timestamp = time.time()
        vocab_size = config.model_config.vocab_size
        prompt_token_ids = vllm_convert.check_generate_request(request, vocab_size)
        params = vllm_convert.sampling_params_from_vllm(
            request.sampling_params, stream=request.stream
        )
        seen: set[int] = set()
        with self.requests.admit(request.request_id, None):
            stream = engine.generate(
                convert.token_ids_prompt(prompt_token_ids),
                params,
                request.request_id,
                trace_headers=_trace_headers(context),
            )
            async with contextlib.aclosing(stream):
                async for output in stream:
                    for completion in output.outputs:
                        if request.stream:
                            first = completion.index not in seen
                            seen.add(completion.index)
                            await context.write(
                                vllm_convert.chunk_response(output, completion, params, first)
                            )
                        if completion.finish_reason is not None:
                            await context.write(
                                vllm_convert.complete_response(output, completion, params)
                            )

    @rpc_method
    async def Embed(self, request: vllm_pb2.EmbedRequest, context: Any) -> Any:
        engine, config = self._ready()
        if not request.request_id:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        vocab_size = config.model_config.vocab_size
        input_ids = vllm_convert.check_input_ids(request.tokenized.input_ids, vocab_size)
        final = None
        with self.requests.admit(request.request_id, None):
            # The protocol's EmbedRequest has no pooling fields (no `dimensions`): the
            # engine's pooler_config decides the pooling type and normalisation.
            stream = engine.encode(
                convert.token_ids_prompt(input_ids),
                PoolingParams(),
                request.request_id,
                trace_headers=_trace_headers(context),
            )
            async with contextlib.aclosing(stream):
                async for output in stream:
                    final = output
        if final is None:
            raise ServiceError(grpc.StatusCode.ABORTED, f"request {request.request_id!r} aborted")
        embedding = final.outputs.data.tolist()
        return vllm_pb2.EmbedResponse(
            embedding=embedding,
            prompt_tokens=len(final.prompt_token_ids),
            embedding_dim=len(embedding),
        )

    @rpc_method
    async def Abort(self, request: vllm_pb2.AbortRequest, context: Any) -> Any:
        engine, _ = self._ready()
        live = [rid for rid in dict.fromkeys(request.request_ids) if rid in self.requests]
        if live:
            await engine.abort(live)
        return vllm_pb2.AbortResponse()

    # ---- state ------------------------------------------------------------------------

    @rpc_method
    async def HealthCheck(self, request: Any, context: Any) -> Any:
        if self.engine is None:
            return vllm_pb2.HealthCheckResponse(healthy=False, message="the engine is loading")
        try:
            await self.engine.check_health()
        except EngineDeadError as exc:
            return vllm_pb2.HealthCheckResponse(healthy=False, message=str(exc))
        if self.health is not None and not self.health.serving:
            # Draining or a stalled step: the gateway should send no more here.
            return vllm_pb2.HealthCheckResponse(healthy=False, message="NOT_SERVING")
        return vllm_pb2.HealthCheckResponse(healthy=True, message="ok")

    @rpc_method
    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        _, config = self._ready()
        return model_info(config)

    @rpc_method
    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        _, config = self._ready()
        return vllm_pb2.GetServerInfoResponse(
            active_requests=len(self.requests),
            is_paused=False,
            last_receive_timestamp=self.last_receive_timestamp,
            uptime_seconds=time.time() - self.started_at,
            server_type="vllm-grpc",  # the protocol spoken (gateways key their client on it)
            data_parallel_size=1,
            # vLLM's setting: "auto" when the cache is in the model dtype.
            kv_cache_dtype=(
                "auto"
                if config.cache_config.cache_dtype in ("auto", config.model_config.dtype)
                else config.cache_config.cache_dtype
            ),
            block_size=config.cache_config.block_size,
            model_dtype=config.model_config.dtype,
            max_num_seqs=config.scheduler_config.max_num_seqs,
        )

    @rpc_method
    async def GetLoads(self, request: vllm_pb2.GetLoadsRequest, context: Any) -> Any:
        engine, config = self._ready()
        if request.HasField("dp_rank") and request.dp_rank != 0:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"dp_rank: this engine has one rank (0), got {request.dp_rank}",
            )
        stats = engine.get_stats()
        block_size = config.cache_config.block_size
        used_blocks = stats.num_total_blocks - stats.num_free_blocks
        load = vllm_pb2.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=stats.num_running,
            num_waiting_reqs=stats.num_waiting,
            num_total_reqs=stats.num_running + stats.num_waiting,
            num_used_tokens=used_blocks * block_size,
            max_total_num_tokens=stats.num_total_blocks * block_size,
            token_usage=stats.kv_cache_usage,
            max_running_requests=config.scheduler_config.max_num_seqs,
        )
        return vllm_pb2.GetLoadsResponse(
            timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(),
            version=_version(),
            dp_rank_count=1,
            loads=[load],
        )

    @rpc_method
    async def FlushCache(self, request: Any, context: Any) -> Any:
        engine, _ = self._ready()
        if await engine.reset_prefix_cache():
            return smg_common_pb2.FlushCacheResponse(success=True, message="prefix cache reset")
        return smg_common_pb2.FlushCacheResponse(
            success=False, message="blocks are in use by running requests; not reset"
        )

    @rpc_method
    async def StartProfile(self, request: Any, context: Any) -> Any:
        raise NotImplementedError("StartProfile: profiling over the protocol is not supported")

    @rpc_method
    async def StopProfile(self, request: Any, context: Any) -> Any:
        raise NotImplementedError("StopProfile: profiling over the protocol is not supported")

    @rpc_method
    async def GetTokenizer(self, request: Any, context: Any) -> None:
        _, config = self._ready()
        directory = config.model_config.tokenizer_dir or config.model_config.model_dir
        data = await asyncio.to_thread(tokenizer_zip, Path(directory))
        digest = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), _TOKENIZER_CHUNK_BYTES):
            end = min(start + _TOKENIZER_CHUNK_BYTES, len(data))
            await context.write(
                smg_common_pb2.GetTokenizerChunk(
                    data=data[start:end], sha256=digest if end == len(data) else ""
                )
            )

    @rpc_method
    async def SubscribeKvEvents(self, request: Any, context: Any) -> None:
        engine, config = self._ready()
        block_size = config.cache_config.block_size
        next_event_id = 0
        async for batch in engine.subscribe_kv_events():
            if batch.sequence_number < request.start_sequence_number:
                continue
            events = vllm_convert.kv_events_to_proto(batch.events, block_size, next_event_id)
            next_event_id += len(events)
            await context.write(
                smg_common_pb2.KvEventBatch(
                    sequence_number=batch.sequence_number,
                    timestamp=batch.timestamp,
                    events=events,
                    dp_rank=0,
                )
            )


def _trace_headers(context: Any) -> dict[str, str] | None:
    """W3C trace context from the call's metadata, with this call's span as the parent
    (the protocol's messages carry none): the engine's `llm_request` span joins the trace."""
    return tracing.outgoing_trace_headers(trace_headers({}, context)) or None


def model_info(config: EngineConfig) -> vllm_pb2.GetModelInfoResponse:
    model, hf = config.model_config, config.model_config.hf_config
    directory = str(model.tokenizer_dir or model.model_dir)
    return vllm_pb2.GetModelInfoResponse(
        model_path=str(model.model_dir),
        is_generation=True,
        max_context_length=model.max_model_len,
        vocab_size=model.vocab_size,
        supports_vision=False,
        served_model_name=model.served_model_name,
        tokenizer_path=directory,
        model_type=str(getattr(hf, "model_type", "")),
        architectures=list(getattr(hf, "architectures", None) or []),
        eos_token_ids=sorted(model.eos_token_ids),
        pad_token_id=_int_or_minus_one(getattr(hf, "pad_token_id", None)),
        bos_token_id=_int_or_minus_one(getattr(hf, "bos_token_id", None)),
        max_req_input_len=model.max_model_len,
        default_sampling_params_json=json.dumps(model.generation_config or {}, default=str),
    )


def _int_or_minus_one(value: Any) -> int:
    return int(value) if isinstance(value, int) else -1


def tokenizer_zip(directory: Path) -> bytes:
    """The model directory's tokenizer files (and configs a gateway reads), zipped."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        found = [name for name in _TOKENIZER_FILES if (directory / name).is_file()]
        if "tokenizer.json" not in found and "tokenizer.model" not in found:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION, f"no tokenizer files in {directory}"
            )
        for name in found:
            archive.write(directory / name, arcname=name)
    return buffer.getvalue()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"pagedserve-{version('pagedserve')}"
    except PackageNotFoundError:
        return "pagedserve"
