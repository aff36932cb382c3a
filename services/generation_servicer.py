"""The servicer of the public API, `pagedserve.v1.TextGenerationService`.

Text in, streamed text out; token ids go to the engine service and back:

    GenerateRequest ─▶ Preprocessor (checks, defaults, chat template, tokenize)
                    ─▶ EngineService.Generate (token ids; stop strings stay here)
    GenerateResponse ◀─ TextStream (incremental detokenization, stop strings, logprob texts)

A request's engine call is cancelled when its client goes away, when every output has
met a stop string, and on Abort (after asking the engine to abort it); cancelling the
call makes the engine service abort the request and free its KV blocks.

Observability (docs/observability.md): each RPC has a SERVER span (`rpc_method`); Generate
adds `tokenize`, a CLIENT span for the engine call (the parent the engine service gets, in
metadata and in `trace_headers`) and `detokenize`; `/metrics` (`metrics_address`) serves
`TokenizerMetrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace

from engine.sampling_params import generation_config_defaults
from pagedserve.v1 import common_pb2, engine_pb2, generation_pb2, generation_pb2_grpc
from services import convert, tracing
from services.beam_search import beam_params_from_request, run_beam_search
from services.caller import current_tenant_name, scoped_request_id
from services.engine_client import EngineBackend
from services.engine_pool import EnginePool, TrackedCall, tracked
from services.errors import (
    ServiceError,
    engine_unreachable,
    invalid_argument,
    rpc_method,
    status_for,
)
from services.grpc_server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ENGINE_SERVICE,
    TEXT_GENERATION_SERVICE,
    trace_headers,
    trace_metadata,
)
from services.limits import RequestRegistry
from services.metrics import TokenizerMetrics
from services.model_files import TextModelFiles
from services.preprocess import Preprocessor
from services.request_limits import RequestChecker, RequestLimits
from services.text_stream import TextStream, TokenTexts
from services.tls import EngineLinkTLS, ServerTLSConfig

logger = logging.getLogger("services.tokenizer")

_ENGINE_RPC_TIMEOUT_S = 5.0  # Abort / Health calls to the engine
_ENGINE_GENERATE = f"{ENGINE_SERVICE}/Generate"  # the CLIENT span of the engine call


@dataclass
class TokenizerServerConfig:
    address: str = "0.0.0.0:50051"
    engine_address: str = "127.0.0.1:50052"
    max_inflight_requests: int = 1024  # more → RESOURCE_EXHAUSTED
    max_prompt_tokens: int | None = None  # None: the engine's max_model_len
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    shutdown_grace_s: float = 10.0  # in-flight streams left after this are aborted
    engine_poll_interval_s: float = 1.0
    # Several engine replicas (services/engine_pool.py): `engine_address` is a comma list
    # of host:port and dns:///name:port entries; names are re-resolved this often.
    engine_dns_refresh_s: float = 5.0
    route_prefix_blocks: int = 4  # affinity key: the prompt's first (up to) N full blocks
    route_max_queue_imbalance: int = 4  # leave the affinity replica when its queue is longer
    route_policy: str = "affinity"  # or "round_robin" (a baseline: benchmarks/routing.py)
    metrics_address: str | None = None  # host:port of /metrics (port 0: a free one); None: off
    tls: ServerTLSConfig | None = None  # the public API's TLS / mTLS; None: plaintext
    engine_tls: EngineLinkTLS = field(default_factory=EngineLinkTLS)  # to the engine
    api_key_file: str | None = None  # None: no keys, every caller is let in
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may cost


@dataclass
class _Live:
    """What the service keeps for a request in flight: its engine calls."""

    calls: list[grpc.aio.Call] = field(default_factory=list)
    aborted: bool = False
    replica: EngineBackend | None = None  # where the request runs (Abort goes there)

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()


class TextGenerationServicer(generation_pb2_grpc.TextGenerationServiceServicer):
    """Thin: proto → preprocess → engine call → proto; errors become statuses in
    `services.errors`."""

    SERVICE_NAME = TEXT_GENERATION_SERVICE

    def __init__(
        self, files: TextModelFiles, backend: EnginePool, config: TokenizerServerConfig
    ) -> None:
        self.tokenizer = files.tokenizer
        self.files = files
        self.backend = backend
        self.config = config
        self.defaults = generation_config_defaults(dict(files.generation_config))
        self.requests: RequestRegistry[_Live] = RequestRegistry(config.max_inflight_requests)
        self.token_texts = TokenTexts(self.tokenizer)
        self.rpc_metrics = TokenizerMetrics(num_inflight=lambda: len(self.requests))
        self.serving = False
        self._preprocessor: Preprocessor | None = None
        self._preprocessor_info: common_pb2.ModelInfo | None = None
        self._checker: RequestChecker | None = None

    def preprocessor(self) -> Preprocessor:
        """Checks need the engine's vocabulary size and max_model_len, known once the engine
        has been reached (then kept while it is down)."""
        info = self.backend.model_info
        if info is None:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                f"the engine service at {self.backend.address} has not been reached yet",
            )
        if info is not self._preprocessor_info:
            self._preprocessor = Preprocessor(
                self.tokenizer,
                self.defaults,
                info.vocab_size,
                info.max_model_len,
                self.config.max_prompt_tokens,
            )
            self._checker = RequestChecker(
                self.config.limits, info.max_model_len, info.max_logprobs
            )
            self._preprocessor_info = info
        assert self._preprocessor is not None
        return self._preprocessor

    def checker(self) -> RequestChecker:
        """What one request may cost (`services.request_limits`), checked before anything is
        tokenized."""
        self.preprocessor()
        assert self._checker is not None
        return self._checker

    @property
    def model_name(self) -> str:
        """In spans: the engine's model (as it was asked for), else our tokenizer's source."""
        info = self.backend.model_info
        return (info.model if info is not None else "") or self.files.source

    @contextlib.contextmanager
    def _tokenizing(self) -> Iterator[None]:
        """Checks, chat template and tokenizer: the `tokenize` span and histogram."""
        start = time.perf_counter()
        with tracing.internal_span("tokenize"):
            yield
        self.rpc_metrics.tokenization_seconds.observe(time.perf_counter() - start)

    # ---- Generate -----------------------------------------------------------------------

    @rpc_method
    async def Generate(self, request: generation_pb2.GenerateRequest, context: Any) -> None:
        span = trace.get_current_span()  # this call's (rpc_method)
        pre = self.preprocessor()
        self.checker().check_generate(request)
        request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        internal_id = scoped_request_id(request_id)  # the tenant's scope, at the engine too
        with self._tokenizing():
            prompt_ids = pre.prompt_token_ids(request)
            params = pre.sampling_params(request.sampling_params)
        tracing.set_request_attributes(span, request_id, self.model_name, params)
        if request.beam_width:
            await self._beam_search(request, request_id, prompt_ids, params, context)
            return
        engine_request = engine_pb2.EngineGenerateRequest(
            request_id=internal_id,
            prompt_token_ids=prompt_ids,
            sampling_params=convert.sampling_params_to_proto(params, include_stop=False),
            priority=request.priority,
            cache_salt=current_tenant_name() or "",  # tenants never share cached blocks
        )
        stream = TextStream(request_id, self.tokenizer, prompt_ids, params, self.token_texts)
        incoming = trace_headers(request.trace_headers, context)
        start = time.perf_counter()
        with self.requests.admit(internal_id, _Live(), request_id) as live:
            await self._generate_at_engine(engine_request, incoming, live, stream, context)
        tracing.set_usage_attributes(
            span, len(prompt_ids), stream.num_tokens, stream.finish_reasons
        )
        self.rpc_metrics.streamed_tokens.inc(stream.num_tokens)
        self.rpc_metrics.streamed_text_chars.inc(stream.num_sent_chars)
        logger.info(
            "request finished",
            extra={
                "request_id": request_id,
                "tenant": current_tenant_name(),
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": stream.num_tokens,
                "aborted": live.aborted,
                "seconds": round(time.perf_counter() - start, 3),
            },
        )

    async def _beam_search(self, request, request_id, prompt_ids, params, context) -> None:
        """`beam_width` set: the final beams as outputs 0..k-1, best first, one message each
        (services/beam_search.py)."""
        try:
            beam_params = beam_params_from_request(request, params)
        except ValueError as exc:
            raise invalid_argument(str(exc)) from None
        eos = set(self.backend.model_info.eos_token_ids) if self.backend.model_info else set()
        internal_id = scoped_request_id(request_id)
        with self.requests.admit(internal_id, _Live(), request_id) as live:
            # Every step's beams go to the prompt's replica, where their blocks are cached.
            live.replica = replica = self.backend.choose(prompt_ids)
            output = await run_beam_search(
                replica.stub,
                internal_id,
                prompt_ids,
                beam_params,
                eos,
                context.time_remaining(),
                _outgoing_metadata(context),
                cache_salt=current_tenant_name() or "",
            )
        for index, beam in enumerate(output.sequences):
            generated = beam.tokens[len(prompt_ids) :]
            shown = generated[:-1] if beam.finish_reason == "stop" else generated
            await context.write(
                generation_pb2.GenerateResponse(
                    request_id=request_id,
                    index=index,
                    text=self.tokenizer.decode(
                        shown, skip_special_tokens=params.skip_special_tokens
                    ),
                    token_ids=generated,
                    finish_reason=convert.FINISH_REASONS[beam.finish_reason],
                    usage=common_pb2.Usage(
                        prompt_tokens=len(prompt_ids), completion_tokens=len(generated)
                    ),
                    cumulative_logprob=beam.cum_logprob,
                )
            )

    async def _generate_at_engine(
        self,
        engine_request: engine_pb2.EngineGenerateRequest,
        incoming_trace_headers: dict[str, str],
        live: _Live,
        stream: TextStream,
        context: grpc.aio.ServicerContext,
    ) -> None:
        """The engine call, under its CLIENT span: the parent the engine service gets, in
        the metadata and in `trace_headers`. Its messages are relayed under `detokenize`."""
        client_span = tracing.start_client_span(_ENGINE_GENERATE)
        try:
            headers = tracing.outgoing_trace_headers(incoming_trace_headers, client_span)
            engine_request.trace_headers.update(headers)
            tried: list[EngineBackend] = []
            while True:
                replica = self.backend.choose(engine_request.prompt_token_ids, exclude=tried)
                tried.append(replica)
                live.replica = replica
                try:
                    with tracing.internal_span("detokenize"):
                        await self._call_replica(
                            replica, engine_request, headers, live, stream, context
                        )
                    return
                except _FailedBeforeFirstToken as failed:
                    # Invisible to the client: mark the replica down, retry once elsewhere.
                    if len(tried) > 1 or not self.backend.up(exclude=tried):
                        raise await replica.translate(failed.error) from None
                    await replica.mark_down(failed.error)
                    self.rpc_metrics.engine_failovers.inc()
                    logger.info(
                        "engine replica failed before the first token; retrying elsewhere",
                        extra={
                            "request_id": engine_request.request_id,
                            "engine_address": replica.address,
                        },
                    )
        except (Exception, asyncio.CancelledError) as exc:
            tracing.set_error(client_span, *status_for(exc))
            raise
        finally:
            client_span.end()

    async def _call_replica(
        self,
        replica: EngineBackend,
        engine_request: engine_pb2.EngineGenerateRequest,
        headers: dict[str, str],
        live: _Live,
        stream: TextStream,
        context: grpc.aio.ServicerContext,
    ) -> None:
        with tracked(replica) as tracking:
            call = replica.stub.Generate(
                engine_request, timeout=context.time_remaining(), metadata=trace_metadata(headers)
            )
            live.calls.append(call)
            try:
                await self._relay(call, replica, tracking, live, stream, context)
            finally:
                call.cancel()  # a no-op once the call is done; else the engine aborts

    async def _relay(
        self,
        call: Any,
        replica: EngineBackend,
        tracking: TrackedCall,
        live: _Live,
        stream: TextStream,
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Engine messages → client messages until every output has ended."""
        try:
            async for msg in call:
                tracking.started()
                response = stream.process(msg)
                if response is not None:
                    await context.write(response)
                if stream.finished:
                    return  # stop strings ended every output: the caller cancels the call
        except asyncio.CancelledError:
            if not live.aborted or context.cancelled() or context.done():
                raise  # our client went away (an Abort cancels only the engine call)
        except grpc.aio.AioRpcError as exc:
            if not live.aborted:
                if engine_unreachable(exc) and tracking.pending:
                    raise _FailedBeforeFirstToken(exc) from None
                raise await replica.translate(exc) from None
        # The engine stream ended (or an Abort cancelled it) with outputs left open.
        for response in stream.abort_unfinished():
            await context.write(response)

    # ---- Abort, Encode ------------------------------------------------------------------

    @rpc_method
    async def Abort(self, request: common_pb2.AbortRequest, context: Any) -> Any:
        tracing.set_abort_attributes(trace.get_current_span(), request.request_ids)
        # Another tenant's ids are not in this caller's scope: they are simply not found.
        live = {
            rid: entry
            for rid in dict.fromkeys(request.request_ids)
            if (entry := self.requests.get(scoped_request_id(rid))) is not None
        }
        if not live:
            return common_pb2.AbortResponse()
        for entry in live.values():
            entry.aborted = True
        engine_aborted: set[str] = set()
        by_replica: dict[EngineBackend, list[str]] = {}
        for rid, entry in live.items():
            if entry.replica is not None:
                by_replica.setdefault(entry.replica, []).append(scoped_request_id(rid))
        for replica, request_ids in by_replica.items():  # each request where it runs
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await replica.stub.Abort(
                    common_pb2.AbortRequest(request_ids=request_ids),
                    timeout=_ENGINE_RPC_TIMEOUT_S,
                    metadata=_outgoing_metadata(context),
                )
                engine_aborted.update(
                    rid for rid in live if scoped_request_id(rid) in reply.aborted_request_ids
                )
        # The engine ends the streams it aborted with finish_reason ABORT; the others (not
        # yet at the engine, or the engine unreachable) end here.
        for rid, entry in live.items():
            if rid not in engine_aborted:
                entry.cancel()
        logger.info("aborted", extra={"request_ids": ",".join(live)})
        return common_pb2.AbortResponse(aborted_request_ids=list(live))

    def abort_all(self) -> None:
        """Shutdown: every in-flight request ends now with finish_reason ABORT."""
        for _, entry in self.requests.items():
            entry.aborted = True
            entry.cancel()

    @rpc_method
    async def Encode(self, request: generation_pb2.EncodeRequest, context: Any) -> Any:
        pre = self.preprocessor()
        self.checker().check_encode(request)
        if request.texts and request.token_ids:
            raise invalid_argument("texts, token_ids: set one of them, not both")
        with self._tokenizing():
            prompts = [
                pre.check_prompt_length(pre.encode_text(text, True, f"texts[{i}]"), f"texts[{i}]")
                for i, text in enumerate(request.texts)
            ] + [
                pre.check_prompt_length(
                    pre.check_token_ids(ids.ids, f"token_ids[{i}].ids"), f"token_ids[{i}]"
                )
                for i, ids in enumerate(request.token_ids)
            ]
        if not prompts:
            raise invalid_argument("texts or token_ids must hold at least one input")
        request_id = request.request_id or f"enc-{uuid.uuid4().hex}"
        internal_id = scoped_request_id(request_id)
        # The engine calls' parent is this call's span.
        headers = tracing.outgoing_trace_headers(trace_headers(request.trace_headers, context))
        with self.requests.admit(internal_id, _Live(), request_id) as live:
            live.replica = replica = self.backend.least_loaded()
            live.calls = [
                replica.stub.Encode(
                    engine_pb2.EngineEncodeRequest(
                        request_id=f"{internal_id}/{i}",
                        prompt_token_ids=ids,
                        pooling_params=request.pooling_params,
                        trace_headers=headers,
                        cache_salt=current_tenant_name() or "",
                    ),
                    timeout=context.time_remaining(),
                    metadata=trace_metadata(headers),
                )
                for i, ids in enumerate(prompts)
            ]
            try:
                replies = await asyncio.gather(*live.calls)
            except grpc.aio.AioRpcError as exc:
                raise await replica.translate(exc) from None
            except asyncio.CancelledError:
                if live.aborted:
                    raise ServiceError(grpc.StatusCode.ABORTED, "the request was aborted") from None
                raise
            finally:
                live.cancel()
        return generation_pb2.EncodeResponse(
            request_id=request_id,
            embeddings=[
                generation_pb2.Embedding(values=r.embedding, prompt_tokens=r.usage.prompt_tokens)
                for r in replies
            ],
            usage=common_pb2.Usage(prompt_tokens=sum(r.usage.prompt_tokens for r in replies)),
        )

    # ---- text utilities, health, model info ---------------------------------------------

    @rpc_method
    async def Tokenize(self, request: generation_pb2.TokenizeRequest, context: Any) -> Any:
        pre = self.preprocessor()
        self.checker().check_tokenize(request)
        kind = request.WhichOneof("input")
        if kind == "text":
            add_special = (
                request.add_special_tokens if request.HasField("add_special_tokens") else True
            )
            ids = pre.encode_text(request.text, add_special, "text")
        elif kind == "chat":
            ids = pre.encode_chat(request.chat)
        else:
            raise invalid_argument("input must be set: one of text or chat")
        return generation_pb2.TokenizeResponse(
            token_ids=ids,
            tokens=self.tokenizer.convert_ids_to_tokens(ids),
            count=len(ids),
            max_model_len=pre.max_model_len,
        )

    @rpc_method
    async def Detokenize(self, request: generation_pb2.DetokenizeRequest, context: Any) -> Any:
        self.checker().check_token_ids(request.token_ids, "token_ids")
        ids = self.preprocessor().check_token_ids(request.token_ids, "token_ids")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return generation_pb2.DetokenizeResponse(
            text=self.tokenizer.decode(ids, skip_special_tokens=skip)
        )

    @rpc_method
    async def GetModelInfo(self, request: common_pb2.GetModelInfoRequest, context: Any) -> Any:
        self.preprocessor()
        return self.backend.model_info

    @rpc_method
    async def Health(self, request: common_pb2.HealthRequest, context: Any) -> Any:
        details = {
            "engine_address": self.backend.address,
            "engine_reachable": str(self.backend.available).lower(),
            "num_inflight_requests": str(len(self.requests)),
            "tokenizer": self.files.source,
        }
        details.update(self.backend.describe())  # every replica: up/down and its load
        engine_healthy = False
        replica = self.backend.any_replica()
        if self.backend.available and replica is not None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await replica.stub.Health(
                    common_pb2.HealthRequest(),
                    timeout=_ENGINE_RPC_TIMEOUT_S,
                    metadata=_outgoing_metadata(context),
                )
                engine_healthy = reply.healthy
                details.update({f"engine.{k}": v for k, v in reply.details.items()})
        healthy = self.serving and engine_healthy
        status = "SERVING" if healthy else "NOT_SERVING"
        return common_pb2.HealthResponse(healthy=healthy, status=status, details=details)


class _FailedBeforeFirstToken(Exception):
    """The replica became unreachable before it sent anything back: safe to retry."""

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        super().__init__(str(error))
        self.error = error


def _outgoing_metadata(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str], ...]:
    """Trace context for an engine call made by this call: its span is the parent."""
    return trace_metadata(tracing.outgoing_trace_headers(trace_headers({}, context)))
