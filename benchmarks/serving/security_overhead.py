"""What security costs per call: the public API in plaintext, with TLS + API keys, and with
mutual TLS on both hops + API keys, on one engine, measured in alternating rounds.

    python benchmarks/serving/security_overhead.py                  # default model, 5 rounds
    python benchmarks/serving/security_overhead.py --rounds 3 --calls 100

Per set-up: the median latency of a unary call (Tokenize: no engine work, so the transport,
the interceptors and the key check are most of it), of a short Generate (16 greedy tokens,
every message over both hops), and of a first call on a new channel (TCP + TLS handshake).
Ratios are against plaintext in the same run. Certificates come from scripts/dev_ca.py (needs
`cryptography`, a dev dependency).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

from clients import Client  # noqa: E402
from engine import AsyncLLMEngine, EngineArgs  # noqa: E402
from services.engine_service.server import EngineServer, EngineServerConfig  # noqa: E402
from services.security.tls import EngineLinkTLS, ServerTLSConfig  # noqa: E402
from services.tokenizer_service.model_files import load_text_model_files  # noqa: E402
from services.tokenizer_service.server import TokenizerServer, TokenizerServerConfig  # noqa: E402

KEY = "bench-key-0123456789abcdef0123"


def _dev_ca(folder: Path) -> None:
    spec = importlib.util.spec_from_file_location("dev_ca", ROOT / "scripts" / "dev_ca.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_dev_pki(folder, [], days=1)


def _setups(certs: Path, keys: Path) -> dict[str, dict[str, Any]]:
    def pem(name: str) -> str:
        return str(certs / f"{name}.pem")

    def key(name: str) -> str:
        return str(certs / f"{name}-key.pem")

    mtls = ServerTLSConfig(pem("engine"), key("engine"), pem("ca"))
    return {
        "plaintext": {"engine": {}, "tokenizer": {}, "client": {}},
        "tls+keys": {
            "engine": {},
            "tokenizer": {
                "tls": ServerTLSConfig(pem("tokenizer"), key("tokenizer")),
                "api_key_file": str(keys),
            },
            "client": {"root_certificates": pem("ca"), "api_key": KEY},
        },
        "mtls both hops+keys": {
            "engine": {"tls": mtls},
            "tokenizer": {
                "tls": ServerTLSConfig(pem("tokenizer"), key("tokenizer"), pem("ca")),
                "engine_tls": EngineLinkTLS(pem("ca"), pem("tokenizer"), key("tokenizer")),
                "api_key_file": str(keys),
            },
            "client": {
                "root_certificates": pem("ca"),
                "private_key": key("client"),
                "certificate_chain": pem("client"),
                "api_key": KEY,
            },
        },
    }


class Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)


def _start(loop: Loop, engine: AsyncLLMEngine, files: Any, setup: dict) -> tuple[Any, Any]:
    async def start() -> tuple[EngineServer, TokenizerServer]:
        engine_server = EngineServer(EngineServerConfig(address="127.0.0.1:0", **setup["engine"]))
        await engine_server.start()
        await engine_server.attach_engine(engine)
        tokenizer = TokenizerServer(
            TokenizerServerConfig(
                address="127.0.0.1:0",
                engine_address=f"localhost:{engine_server.port}",
                **setup["tokenizer"],
            ),
            files,
        )
        await tokenizer.start()
        assert await tokenizer.backend.wait_until_available(60)
        return engine_server, tokenizer

    return loop.run(start())


def _median_ms(fn: Callable[[], Any], n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def _round(address: str, client_kwargs: dict, calls: int) -> dict[str, float]:
    with Client(address, timeout=60, **client_kwargs) as client:
        client.tokenize("warm up")
        unary = _median_ms(lambda: client.tokenize("The capital of France is"), calls)
        generate = _median_ms(
            lambda: client.generate_text(
                token_ids=[5, 6, 7, 8], max_tokens=16, temperature=0, ignore_eos=True
            ),
            max(calls // 10, 5),
        )

    def first_call() -> None:
        with Client(address, timeout=60, **client_kwargs) as fresh:
            fresh.tokenize("x")

    connect = _median_ms(first_call, max(calls // 10, 5))
    return {"tokenize_ms": unary, "generate16_ms": generate, "new_channel_ms": connect}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="(default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200, help="unary calls per round")
    args = parser.parse_args()
    engine_args = EngineArgs(model=args.model, skip_tokenizer_init=True)
    engine_args.kv_cache_memory_bytes = 256 << 20
    engine = AsyncLLMEngine.from_engine_args(engine_args)
    files = load_text_model_files(args.model)
    loop = Loop()
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        certs, keys = Path(tmp) / "certs", Path(tmp) / "keys"
        _dev_ca(certs)
        keys.write_text(f"{KEY} bench\n")
        setups = _setups(certs, keys)
        servers = {name: _start(loop, engine, files, s) for name, s in setups.items()}
        for _ in range(args.rounds):  # alternate, so drift in the machine's load is shared
            for name, setup in setups.items():
                address = f"localhost:{servers[name][1].port}"
                results.setdefault(name, []).append(_round(address, setup["client"], args.calls))
        for engine_server, tokenizer in servers.values():
            loop.run(tokenizer.stop(0))
            loop.run(engine_server.stop(0))
    engine.shutdown()
    base = {
        k: statistics.median(r[k] for r in results["plaintext"]) for k in results["plaintext"][0]
    }
    print(f"{'set-up':<22}" + "".join(f"{k:>26}" for k in base))
    for name, rounds in results.items():
        cells = []
        for k in base:
            value = statistics.median(r[k] for r in rounds)
            cells.append(f"{value:9.2f} ({value / base[k]:4.2f}x)".rjust(26))
        print(f"{name:<22}" + "".join(cells))


if __name__ == "__main__":
    main()
