"""The engine API's servicer: `pagedserve.v1.EngineService` RPCs over one `AsyncLLMEngine`.

Token ids in, token-id deltas out; it never sees text (the engine runs with
`skip_tokenizer_init=True`). One stream per request:

    EngineGenerateRequest ──▶ engine.generate(..., output_kind=DELTA, detokenize=False)
    EngineGenerateResponse ◀── one message per changed output index per engine step

The same per-request path (`generate_one`) serves the requests of a GenerateStream call, many
requests over one call with one batch of messages per step (stream_servicer.py).

When the client cancels (or its deadline passes) gRPC cancels the handler; closing the
engine's generator then aborts the request, which frees its KV blocks at once. A request the
server hands back while draining (services/engine_service/server.py) ends with UNAVAILABLE and
the migrate metadata instead of an abort.

Apart from the server because it is the proto → engine → proto translation only (thin, as
`admin.py`, `lora.py` and `vllm_servicer.py` beside it); the process's lifecycle (listening,
attaching the engine, the watchdog, draining) is the server's.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from typing import Any, Protocol

import grpc
from opentelemetry import trace

from engine import (
    AsyncLLMEngine,
    EngineConfig,
    EngineDeadError,
    RequestOutput,
    RequestOutputKind,
)
from pagedserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.common import tracing
from services.common.errors import (
    ServiceError,
    invalid_argument,
    rpc_method,
    status_for,
)
from services.common.grpc_server import ENGINE_SERVICE, HealthReporter, trace_headers
from services.common.limits import RequestRegistry
from services.common.metrics import EngineServiceMetrics
from services.common.migration import INSTANCE_DETAIL, REASON_DRAINED, migrate_metadata
from services.engine_service import convert
from services.engine_service.admin import EngineAdminRpcs
from services.engine_service.lora import EngineLoraRpcs
from services.engine_service.stream_servicer import EngineStreamRpcs

logger = logging.getLogger("services.engine")

WriteResponse = Callable[[engine_pb2.EngineGenerateResponse], Awaitable[Any]]


class ResponseBatch(Protocol):
    """Where a multiplexed request's messages go (stream_servicer.StreamBatchWriter's view
    for one request): a message built inside the batch from its field values
    (`EngineResponseBuilder.fields`), or a copy of a built one."""

    def add_fields(self, fields: dict[str, Any]) -> None: ...

    def add(self, response: engine_pb2.EngineGenerateResponse) -> None: ...


INSTANCE_ID = uuid.uuid4().hex  # this process's (Health details: INSTANCE_DETAIL)


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


class EngineServicer(
    EngineStreamRpcs, EngineAdminRpcs, EngineLoraRpcs, engine_pb2_grpc.EngineServiceServicer
):
    """Thin: proto → engine call → proto; errors become statuses in `services.common.errors`."""

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
        self.draining = False  # SIGTERM came: new requests are refused (handed back)
        self.stalled_s = 0.0  # how long the stuck step had run when the watchdog fired
        self._handing_back: set[str] = set()  # ids whose streams end "migrate", not abort

    def hand_back(self, request_ids: list[str]) -> None:
        """Marks requests whose streams must end with the migrate status (the caller then
        aborts them in the engine, which frees their blocks)."""
        self._handing_back.update(request_ids)

    def _check_accepting(self) -> None:
        if self.draining:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                "the engine service is draining: send the request to another replica",
                migrate_metadata(REASON_DRAINED),
            )

    def _ready_engine(self) -> AsyncLLMEngine:
        if self.engine is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the engine is still loading")
        return self.engine

    @rpc_method
    async def Generate(self, request: engine_pb2.EngineGenerateRequest, context: Any) -> None:
        await self.generate_one(request, context, context.write)

    async def generate_one(
        self,
        request: engine_pb2.EngineGenerateRequest,
        context: Any,
        write: WriteResponse | None = None,
        batch: ResponseBatch | None = None,
    ) -> None:
        """One Generate request. Its messages go to `write` (the call's own stream:
        Generate) through the engine's per-request generator, or, with `batch`, straight
        into the batch of a multiplexed call (GenerateStream, stream_servicer.py), built in
        the engine thread's hand-over of each step. Raises what the request's status
        comes from."""
        with _fields_named_by_proto_path():
            await self._generate(request, context, write, batch)

    async def _generate(
        self,
        request: engine_pb2.EngineGenerateRequest,
        context: Any,
        write: WriteResponse | None,
        batch: ResponseBatch | None,
    ) -> None:
        span = trace.get_current_span()  # the request's SERVER span: llm_request's parent
        engine = self._ready_engine()
        self._check_accepting()
        request_id = _check_request_id(request.request_id)
        params = convert.sampling_params_from_proto(
            request.sampling_params, output_kind=RequestOutputKind.DELTA, detokenize=False
        )
        lora_request = self.lora_request_for(request.lora_name)
        tracing.set_request_attributes(span, request_id, self.model_name, params)
        if lora_request is not None:
            span.set_attribute("gen_ai.request.lora_name", lora_request.lora_name)
        resumed = convert.resumed_output_token_ids_from_proto(request)
        builder = convert.EngineResponseBuilder(request_id, params, resumed)
        start = time.perf_counter()
        prompt = convert.token_ids_prompt(request.prompt_token_ids, request.cache_salt)
        run_options = dict(
            resumed_output_token_ids=resumed, **_request_options(request, context, lora_request)
        )
        with self.requests.admit(request_id, None):
            try:
                if batch is not None:
                    on_output = _into_batch(builder, batch, self._handing_back)
                    await engine.generate_into(prompt, params, request_id, on_output, **run_options)
                else:
                    assert write is not None
                    stream = engine.generate(prompt, params, request_id, **run_options)
                    await _write_each(stream, builder, write, self._handing_back)
            finally:
                handed_back = request_id in self._handing_back
                self._handing_back.discard(request_id)
        if handed_back and "abort" in builder.finish_reasons.values():
            raise _handed_back_error(request_id)
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
                "resumed_tokens": sum(len(t) for t in (resumed or {}).values()),
                "seconds": round(time.perf_counter() - start, 3),
            },
        )

    @rpc_method
    async def Encode(
        self, request: engine_pb2.EngineEncodeRequest, context: Any
    ) -> engine_pb2.EngineEncodeResponse:
        with _fields_named_by_proto_path():
            return await self._encode(request, context)

    async def _encode(
        self, request: engine_pb2.EngineEncodeRequest, context: Any
    ) -> engine_pb2.EngineEncodeResponse:
        engine = self._ready_engine()
        self._check_accepting()
        request_id = _check_request_id(request.request_id)
        params = convert.pooling_params_from_proto(request.pooling_params)
        lora_request = self.lora_request_for(request.lora_name)
        final = None
        with self.requests.admit(request_id, None):
            stream = engine.encode(
                convert.token_ids_prompt(request.prompt_token_ids, request.cache_salt),
                params,
                request_id,
                **_request_options(request, context, lora_request),
            )
            try:
                async with contextlib.aclosing(stream):
                    async for output in stream:
                        final = output
            finally:
                handed_back = request_id in self._handing_back
                self._handing_back.discard(request_id)
        if final is None and handed_back:
            raise _handed_back_error(request_id)
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
        # The process's id: a router tells a replica restarted at the same address (a new
        # one) from one that recovered (which may still hold requests that moved away).
        details = {"num_inflight_streams": str(len(self.requests)), INSTANCE_DETAIL: INSTANCE_ID}
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
        if self.draining:
            details["draining"] = "true"
        if self.stalled_s:
            details["engine_stalled_s"] = f"{self.stalled_s:.1f}"
        healthy = healthy and self.health.serving
        status = "SERVING" if healthy else "NOT_SERVING"
        return common_pb2.HealthResponse(healthy=healthy, status=status, details=details)

    @rpc_method
    async def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: Any
    ) -> common_pb2.ModelInfo:
        self._ready_engine()
        return self.model_info


def _into_batch(
    builder: convert.EngineResponseBuilder, batch: ResponseBatch, handing_back: set[str]
) -> Callable[[RequestOutput], None]:
    """A GenerateStream request's `on_output`: its messages built straight into the call's
    batch (a request being handed back goes through `_without_abort` first)."""
    request_id = builder.request_id

    def on_output(output: RequestOutput) -> None:
        if request_id not in handing_back:
            for fields in builder.fields(output):
                batch.add_fields(fields)
            return
        for response in builder.build(output):
            response = _without_abort(response)
            if response is not None:
                batch.add(response)

    return on_output


async def _write_each(
    stream: AsyncGenerator[RequestOutput, None],
    builder: convert.EngineResponseBuilder,
    write: WriteResponse,
    handing_back: set[str],
) -> None:
    """A Generate call's messages, written as the engine's generator yields outputs."""
    async with contextlib.aclosing(stream):
        async for output in stream:
            for response in builder.build(output):
                if builder.request_id in handing_back:
                    response = _without_abort(response)
                if response is not None:
                    await write(response)


def _without_abort(
    response: engine_pb2.EngineGenerateResponse,
) -> engine_pb2.EngineGenerateResponse | None:
    """A handed-back stream's abort message: its tokens (if any) without the finish
    reason, which would tell the tokenizer service the output ended; None if nothing is
    left to send."""
    if response.finish_reason != common_pb2.FINISH_REASON_ABORT:
        return response
    if not response.token_ids:
        return None
    response.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
    response.ClearField("stop_reason")
    return response


def _handed_back_error(request_id: str) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.UNAVAILABLE,
        f"the engine service drained: resume request {request_id!r} on another replica",
        migrate_metadata(REASON_DRAINED),
    )


def _request_options(request: Any, context: Any, lora_request: Any) -> dict[str, Any]:
    """The engine call's keyword arguments Generate and Encode requests share."""
    return dict(
        trace_headers=_engine_trace_headers(request, context),
        priority=request.priority,
        lora_request=lora_request,
        fairness_key=request.fairness_key or None,
        fairness_weight=request.fairness_weight or 1.0,  # 0: unset
    )


def _engine_trace_headers(request: Any, context: Any) -> dict[str, str] | None:
    """The request's trace headers for the engine, with this call's span as the parent."""
    incoming = trace_headers(request.trace_headers, context)
    return tracing.outgoing_trace_headers(incoming) or None


@contextlib.contextmanager
def _fields_named_by_proto_path() -> Iterator[None]:
    """A rejected parameter's status names it by its proto path (`convert.field_path_message`);
    the code is the one `status_for` gives the engine's error."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        code, message = status_for(exc)
        raise ServiceError(code, convert.field_path_message(message)) from exc


def _check_request_id(request_id: str) -> str:
    if not request_id:
        raise invalid_argument("request_id must not be empty")
    return request_id
