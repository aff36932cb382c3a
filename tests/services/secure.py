"""Extra servers on the session's engine for the security tests: TLS, mTLS, API keys.

Certificates come from `scripts/dev_ca.py` (the development CA the deployment docs use):
a CA, a server/client certificate for localhost, an expired one, and one from another CA.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

from services.engine_service.server import EngineServer, EngineServerConfig
from services.tokenizer_service.server import TokenizerServer, TokenizerServerConfig

ROOT = Path(__file__).resolve().parents[2]


def dev_ca() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dev_ca", ROOT / "scripts" / "dev_ca.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Pki:
    """PEM files under one folder: `<name>.pem` and `<name>-key.pem` each."""

    folder: Path

    def cert(self, name: str) -> str:
        return str(self.folder / f"{name}.pem")

    def key(self, name: str) -> str:
        return str(self.folder / f"{name}-key.pem")

    def read(self, name: str) -> bytes:
        return (self.folder / f"{name}.pem").read_bytes()

    def channel_credentials(self, ca: str = "ca", client: str | None = None):
        pair = (None, None)
        if client is not None:
            pair = ((self.folder / f"{client}-key.pem").read_bytes(), self.read(client))
        return grpc.ssl_channel_credentials(self.read(ca), *pair)


def make_pki(folder: Path) -> Pki:
    ca_module = dev_ca()
    ca, other_ca = ca_module.make_ca(), ca_module.make_ca("another CA")
    ca.write(folder, "ca")
    other_ca.write(folder, "other-ca")
    names = ["localhost", "127.0.0.1"]
    ca_module.issue(ca, "server", names).write(folder, "server")
    ca_module.issue(ca, "client", []).write(folder, "client")
    ca_module.issue(ca, "expired", [], expired=True).write(folder, "expired")
    ca_module.issue(other_ca, "stranger", names).write(folder, "stranger")
    return Pki(folder)


def start_engine_server(stack: Any, **config: Any) -> EngineServer:
    async def start() -> EngineServer:
        server = EngineServer(EngineServerConfig(address="127.0.0.1:0", **config))
        await server.start()
        await server.attach_engine(stack.engine)
        return server

    return stack.loop.run(start())


def start_tokenizer_server(
    stack: Any, engine_port: int, wait: bool = True, **config: Any
) -> TokenizerServer:
    async def start() -> TokenizerServer:
        server = TokenizerServer(
            TokenizerServerConfig(
                address="127.0.0.1:0",
                engine_address=f"127.0.0.1:{engine_port}",
                engine_poll_interval_s=0.2,
                **config,
            ),
            stack.files,
        )
        await server.start()
        if wait:
            assert await server.backend.wait_until_available(30.0)
        return server

    return stack.loop.run(start())


def stop(stack: Any, *servers: Any) -> None:
    for server in servers:
        stack.loop.run(server.stop(0))
