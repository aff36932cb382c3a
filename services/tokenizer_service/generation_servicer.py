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
`TokenizerMetrics`. The engine call itself (replica choice, failover before the first token,
the relay of engine messages) is services/tokenizer_service/replicas/relay.py.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
from opentelemetry import trace

from engine.api.sampling_params import generation_config_defaults
from pagedserve.v1 import common_pb2, engine_pb2, generation_pb2, generation_pb2_grpc
from services.common import tracing
from services.common.errors import (
    ServiceError,
    invalid_argument,
    rpc_method,
)
from services.common.grpc_server import (
    TEXT_GENERATION_SERVICE,
    trace_headers,
)
from services.common.limits import RequestRegistry
from services.common.metrics import TokenizerMetrics
from services.security.caller import current_tenant_name, fairness_fields, scoped_request_id
from services.tokenizer_service.beam_search import (
    beam_params_from_request,
    beam_responses,
    run_beam_search,
)
from services.tokenizer_service.config import TokenizerServerConfig
from services.tokenizer_service.lora_admin import PublicLoraRpcs
from services.tokenizer_service.model_files import TextModelFiles
from services.tokenizer_service.preprocess import Preprocessor
from services.tokenizer_service.replicas.engine_client import EngineBackend
from services.tokenizer_service.replicas.pool import EnginePool
from services.tokenizer_service.replicas.relay import EngineRelay, LiveRequest, outgoing_metadata
from services.tokenizer_service.request_limits import RequestChecker
from services.tokenizer_service.text_stream import TextStream, TokenTexts

logger = logging.getLogger("services.tokenizer")

_ENGINE_RPC_TIMEOUT_S = 5.0  # Abort / Health calls to the engine


class TextGenerationServicer(PublicLoraRpcs, generation_pb2_grpc.TextGenerationServiceServicer):
    """Thin: proto → preprocess → engine call → proto; errors become statuses in
    `services.common.errors`. The LoRA admin RPCs are `services.tokenizer_service.lora_admin`."""

    SERVICE_NAME = TEXT_GENERATION_SERVICE

    def __init__(
        self, files: TextModelFiles, backend: EnginePool, config: TokenizerServerConfig
    ) -> None:
        self.tokenizer = files.tokenizer
        self.files = files
        self.backend = backend
        self.config = config
        self.defaults = generation_config_defaults(dict(files.generation_config))
        self.requests: RequestRegistry[LiveRequest] = RequestRegistry(config.max_inflight_requests)
        self.token_texts = TokenTexts(self.tokenizer)
        self.rpc_metrics = TokenizerMetrics(num_inflight=lambda: len(self.requests))
        self.relay = EngineRelay(
            backend, self.rpc_metrics, config.migration_limit, config.stream_interval
        )
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
            self._checker = RequestChecker(self.config.limits, info.max_model_len)
            self._preprocessor_info = info
        assert self._preprocessor is not None
        return self._preprocessor

    def checker(self) -> RequestChecker:
        """What one request may cost (`services.tokenizer_service.request_limits`), checked before
        anything is
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
            params = pre.sampling(request.sampling_params)
            engine_sampling = params.engine_proto(self.tokenizer)  # bad words to token ids
        tracing.set_request_attributes(span, request_id, self.model_name, params)
        if request.beam_width:
            await self._beam_search(request, request_id, prompt_ids, params, context)
            return
        engine_request = engine_pb2.EngineGenerateRequest(
            request_id=internal_id,
            prompt_token_ids=prompt_ids,
            sampling_params=engine_sampling,
            priority=request.priority,
            cache_salt=current_tenant_name() or "",  # tenants never share cached blocks
            lora_name=request.lora_name,  # unknown: the engine's NOT_FOUND, passed through
            **fairness_fields(),  # the engine shares its batch fairly between tenants
        )
        stream = TextStream(request_id, self.tokenizer, prompt_ids, params, self.token_texts)
        incoming = trace_headers(request.trace_headers, context)
        start = time.perf_counter()
        with self.requests.admit(internal_id, LiveRequest(), request_id) as live:
            await self.relay.generate(engine_request, incoming, live, stream, context)
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
        (services/tokenizer_service/beam_search.py)."""
        try:
            beam_params = beam_params_from_request(request, params)
        except ValueError as exc:
            raise invalid_argument(str(exc)) from None
        eos = set(self.backend.model_info.eos_token_ids) if self.backend.model_info else set()
        internal_id = scoped_request_id(request_id)
        with self.requests.admit(internal_id, LiveRequest(), request_id) as live:
            # Every step's beams go to the prompt's replica, where their blocks are cached.
            live.replica = replica = self.backend.choose(prompt_ids)
            output = await run_beam_search(
                replica.stub,
                internal_id,
                prompt_ids,
                beam_params,
                eos,
                context.time_remaining(),
                outgoing_metadata(context),
                cache_salt=current_tenant_name() or "",
                lora_name=request.lora_name,
                fairness=fairness_fields(),
                live=live,
            )
        for response in beam_responses(
            output, request_id, prompt_ids, self.tokenizer, params.skip_special_tokens
        ):
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
                    metadata=outgoing_metadata(context),
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
        # The pooling parameters and the token ids are the engine's to check.
        with self._tokenizing():
            prompts = [
                pre.check_prompt_length(pre.encode_text(text, True, f"texts[{i}]"), f"texts[{i}]")
                for i, text in enumerate(request.texts)
            ] + [
                pre.check_prompt_length(list(ids.ids), f"token_ids[{i}]")
                for i, ids in enumerate(request.token_ids)
            ]
        if not prompts:
            raise invalid_argument("texts or token_ids must hold at least one input")
        request_id = request.request_id or f"enc-{uuid.uuid4().hex}"
        internal_id = scoped_request_id(request_id)
        engine_requests = [
            engine_pb2.EngineEncodeRequest(
                request_id=f"{internal_id}/{i}",
                prompt_token_ids=ids,
                pooling_params=request.pooling_params,
                cache_salt=current_tenant_name() or "",
                lora_name=request.lora_name,
                **fairness_fields(),
            )
            for i, ids in enumerate(prompts)
        ]
        incoming = trace_headers(request.trace_headers, context)
        with self.requests.admit(internal_id, LiveRequest(), request_id) as live:
            replies = await self.relay.encode(engine_requests, incoming, live, context)
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
                    metadata=outgoing_metadata(context),
                )
                engine_healthy = reply.healthy
                details.update({f"engine.{k}": v for k, v in reply.details.items()})
        healthy = self.serving and engine_healthy
        status = "SERVING" if healthy else "NOT_SERVING"
        return common_pb2.HealthResponse(healthy=healthy, status=status, details=details)
