"""Compiles constraints off the engine step and hands each request its grammar state.

    add_request ── check(spec) (fast, raises ValueError) ── cache hit? ── Future
                                                            └─ no: pool.submit(compile)
    scheduler ── request.structured_output.is_ready() ── admit from the queue
    runner    ── matcher.fill_bitmask(row) ── sampler masks the batch in one op

Compiled grammars are cached by (kind, spec), an LRU of `_CACHE_SIZE` entries, so identical
constraints (the n samples of a request, or a service's recurring schemas) compile once and
concurrent identical requests wait on one compilation. The backend itself (tokenizer
vocabulary scan) is built on the pool at the first constrained request, so an engine that
never sees one never pays for it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.api.model_files import load_tokenizer
from engine.api.structured_outputs import StructuredOutputsParams
from engine.config.resolved import ModelConfig
from engine.core.request import Request
from engine.structured_output.config import DecodingConfig
from engine.structured_output.request import StructuredOutputRequest

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256
_NUM_WORKERS = 1  # compilations are multi-threaded inside xgrammar already


class StructuredOutputManager:
    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config
        self._executor: ThreadPoolExecutor | None = None
        self._backend: Any = None
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._failed_lock = threading.Lock()
        self._failed: list[str] = []  # request ids whose grammar failed to compile
        self._compiled_event = threading.Event()  # set when any compilation ends

    @property
    def decoding_config(self) -> DecodingConfig:
        # backend.py imports xgrammar (and torch): only where structured outputs are used
        from engine.structured_output.backend import BACKEND_NAME

        return DecodingConfig(backend=BACKEND_NAME)

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        """Raises ValueError with the library's reason if it rejects the spec."""
        from engine.structured_output.backend import check

        check(params)

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        assert params is not None and params.structured_outputs is not None
        compiled = self._compiled(params.structured_outputs)
        request_id = request.request_id
        request.structured_output = StructuredOutputRequest(
            compiled,
            self._new_matcher,
            resumed_token_ids=list(request.output_token_ids),
            on_refused=lambda error: self._fail(request_id, error),
        )
        compiled.add_done_callback(lambda f: self._on_done(request_id, f))

    def _compiled(self, params: StructuredOutputsParams) -> Future[Any]:
        key = params.key()
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        if self._executor is None:
            self._executor = ThreadPoolExecutor(_NUM_WORKERS, thread_name_prefix="grammar")
        future = self._executor.submit(self._compile, params)
        self._cache[key] = future
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams) -> Any:
        return self._get_backend().compile(params)

    def _get_backend(self) -> Any:
        with self._backend_lock:
            if self._backend is None:
                from engine.structured_output.backend import XgrammarBackend

                config = self.model_config
                tokenizer = load_tokenizer(config.tokenizer_dir or config.model_dir)
                self._backend = XgrammarBackend(
                    tokenizer, config.vocab_size, sorted(config.eos_token_ids)
                )
            return self._backend

    def _new_matcher(self, compiled: Any) -> Any:
        return self._get_backend().new_matcher(compiled)

    def _on_done(self, request_id: str, future: Future[Any]) -> None:
        self._compiled_event.set()
        if future.exception() is not None:
            self._fail(request_id, future.exception())

    def _fail(self, request_id: str, error: BaseException | None) -> None:
        """The request's grammar failed to compile or refused its resumed output: the engine
        aborts it at its next step (`take_failed`)."""
        logger.warning("Grammar of request %s failed: %s", request_id, error)
        with self._failed_lock:
            self._failed.append(request_id)

    def wait_for_compilation(self, timeout: float) -> None:
        """Blocks until a compilation ends (or `timeout` seconds pass)."""
        self._compiled_event.wait(timeout)
        self._compiled_event.clear()

    def take_failed(self) -> list[str]:
        """Ids of requests whose grammar failed to compile since the last call."""
        with self._failed_lock:
            failed, self._failed = self._failed, []
        return failed

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
