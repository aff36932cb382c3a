"""Real servers on loopback ports for the service tests.

One `ServiceStack` per session: an `AsyncLLMEngine` on a tiny random Llama (with the
default model's tokenizer), its engine service and a tokenizer service in front, all run by
an asyncio loop in a background thread. Tests talk to them with ordinary gRPC clients, and
may read the in-process engine's stats directly.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine import LLM, AsyncLLMEngine, EngineArgs, EngineStats
from pagedserve.v1 import engine_pb2_grpc, generation_pb2_grpc
from services.engine_service.server import EngineServer, EngineServerConfig
from services.tokenizer_service.model_files import load_text_model_files
from services.tokenizer_service.server import TokenizerServer, TokenizerServerConfig
from tests.model_utils import make_tiny_llama

# Small and fast: a 64 MiB cache is thousands of blocks for the tiny model.
ENGINE_KWARGS: dict[str, Any] = {"kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 128}


class LoopThread:
    """An asyncio event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class ServiceStack:
    def __init__(
        self,
        model_dir: Path,
        engine_server_config: dict[str, Any] | None = None,
        tokenizer_server_config: dict[str, Any] | None = None,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        """The `*_server_config` dicts are extra `EngineServerConfig` /
        `TokenizerServerConfig` fields; `engine_args` replace or add to `ENGINE_KWARGS`."""
        self.model_dir = model_dir
        self.engine_server_config = engine_server_config or {}
        self.loop = LoopThread()
        self.engine = AsyncLLMEngine.from_engine_args(
            EngineArgs(
                model=str(model_dir),
                skip_tokenizer_init=True,
                **{**ENGINE_KWARGS, **(engine_args or {})},
            )
        )
        self.files = load_text_model_files(str(model_dir))
        self.engine_server: EngineServer | None = None
        self.engine_port = 0
        self.start_engine_server()
        self.tokenizer_server = self.start_tokenizer_server(**(tokenizer_server_config or {}))
        self.public_port = self.tokenizer_server.port
        self.public_channel = grpc.insecure_channel(f"127.0.0.1:{self.public_port}")
        self.engine_channel = grpc.insecure_channel(f"127.0.0.1:{self.engine_port}")
        self.public = generation_pb2_grpc.TextGenerationServiceStub(self.public_channel)
        self.engine_stub = engine_pb2_grpc.EngineServiceStub(self.engine_channel)

    # ---- servers ----------------------------------------------------------------------

    def start_engine_server(self) -> None:
        """(Re)starts the engine service on its port (a free one the first time)."""

        async def start() -> EngineServer:
            server = EngineServer(
                EngineServerConfig(
                    address=f"127.0.0.1:{self.engine_port}", **self.engine_server_config
                )
            )
            await server.start()
            await server.attach_engine(self.engine)
            return server

        self.engine_server = self.loop.run(start())
        self.engine_port = self.engine_server.port

    def stop_engine_server(self, grace: float = 0.0) -> None:
        assert self.engine_server is not None
        self.loop.run(self.engine_server.stop(grace))
        self.engine_server = None

    def start_tokenizer_server(self, **config: Any) -> TokenizerServer:
        """A tokenizer service in front of the stack's engine service (unless `config`
        names other `engine_address`es)."""
        defaults = dict(engine_address=f"127.0.0.1:{self.engine_port}", engine_poll_interval_s=0.2)

        async def start() -> TokenizerServer:
            server = TokenizerServer(
                TokenizerServerConfig(address="127.0.0.1:0", **{**defaults, **config}),
                self.files,
            )
            await server.start()
            assert await server.backend.wait_until_available(30.0)
            return server

        return self.loop.run(start())

    def close(self) -> None:
        self.public_channel.close()
        self.engine_channel.close()
        self.loop.run(self.tokenizer_server.stop(0))
        if self.engine_server is not None:
            self.loop.run(self.engine_server.stop(0))
        self.engine.shutdown()
        self.loop.close()

    # ---- the engine's state -----------------------------------------------------------

    def stats(self) -> EngineStats:
        return self.engine.get_stats()

    def wait_until_idle(self, timeout: float = 60.0) -> EngineStats:
        """Waits until no request is left (in the engine and in the engine service's registry
        of live request ids) and every KV block is free again."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            idle = stats.num_running == stats.num_waiting == stats.num_requests == 0
            if self.engine_server is not None:
                idle = idle and len(self.engine_server.servicer.requests) == 0
            if idle and stats.num_free_blocks == stats.num_total_blocks:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine is not idle after {timeout} s: {stats}")
            time.sleep(0.02)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A long context: tests keep streams running with max_tokens in the thousands, and the
    # public API refuses max_tokens over the model's length.
    return make_tiny_llama(
        tmp_path_factory.mktemp("services") / "tiny",
        with_tokenizer=True,
        max_position_embeddings=4096,
    )


@pytest.fixture(scope="session")
def stack(tiny_model_dir: Path) -> Iterator[ServiceStack]:
    stack = ServiceStack(tiny_model_dir)
    yield stack
    stack.close()


@pytest.fixture(scope="session")
def offline_llm(tiny_model_dir: Path) -> LLM:
    """The in-process reference: the same model and engine arguments (the served engine's
    step budget too: the offline `LLM` would take larger steps by default)."""
    return LLM(model=str(tiny_model_dir), max_num_batched_tokens=None, **ENGINE_KWARGS)
