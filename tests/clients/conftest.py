"""Real servers for the client tests: the services' `ServiceStack` (a tiny random Llama with
the default model's tokenizer, an engine service and a tokenizer service in-process), and a
small fake of the public API for what a real server cannot be made to do on cue."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.clients.fake_server import FakeService, start_fake_server
from tests.model_utils import make_tiny_llama
from tests.services.conftest import ServiceStack


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("clients") / "tiny", with_tokenizer=True)


@pytest.fixture(scope="session")
def stack(tiny_model_dir: Path) -> Iterator[ServiceStack]:
    stack = ServiceStack(tiny_model_dir)
    yield stack
    stack.close()


@pytest.fixture(scope="session")
def address(stack: ServiceStack) -> str:
    """The public API's address."""
    return f"127.0.0.1:{stack.public_port}"


@pytest.fixture
def fake() -> Iterator[Callable[..., str]]:
    """Starts fake public APIs (`fake(service, credentials=...)` → its address); stops them
    after the test."""
    servers: list[grpc.Server] = []

    def start(service: FakeService, **kwargs: Any) -> str:
        server, port = start_fake_server(service, **kwargs)
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)
