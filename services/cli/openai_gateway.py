"""The OpenAI-compatible HTTP door: the third-party `smg` gateway (PyPI `smg`, the `gateway`
extra) in front of the engine replicas, over vLLM's engine protocol, which the engine port
also serves (services/engine_service/vllm_servicer.py). smg tokenizes, applies the chat
template and serves `/v1/chat/completions`, `/v1/completions` and `/v1/models` itself, so
this module only starts it and tells it where the engines are.

    pagedserve gateway --engine-addr dns:///engine:50052 --port 8000
    pagedserve serve --openai-port 8000        # the same gateway beside the two services

`--engine-addr` takes the tokenizer service's syntax (comma-separated `host:port` and
`dns:///name:port`). smg has no DNS discovery of its own, only a JSON manifest it rereads
when it changes, so this process resolves every `dns:///` name every few seconds and rewrites
the manifest: each address behind the name whose engine reports SERVING is one smg worker,
which is what `--scale engine=N` needs for `cache_aware` routing to see N replicas (a
replica joins once it has loaded and leaves when it drains). smg is a child process
that dies with this one (PR_SET_PDEATHSIG on Linux) and gets SIGTERM when this one does.

What the gateway does not do (docs/deployment.md, "The OpenAI-compatible API"): pagedserve's
API keys and TLS (it has its own `--api-key`; `serve --openai-port` refuses
`--api-key-file` and TLS rather than open an unchecked door), and `logprobs` on
`/v1/completions` (smg 1.13.0 leaves them out on that route; chat `logprobs` work).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

logger = logging.getLogger("services.cli.openai_gateway")

SMG_ENV = "PAGEDSERVE_SMG"
INSTALL_HINT = "pip install 'pagedserve[gateway]'"
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "prefix_hash")
DEFAULT_GATEWAY_PORT = 8000
_SMG_LOG_LEVELS = {"DEBUG": "debug", "INFO": "info", "WARNING": "warn", "ERROR": "error"}


# ---- flags ------------------------------------------------------------------------------


def add_serve_openai_args(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("OpenAI-compatible API (the smg gateway, docs/deployment.md)")
    group.add_argument(
        "--openai-port",
        type=int,
        default=int(os.environ.get("PAGEDSERVE_OPENAI_PORT") or 0),
        help="also serve /v1/chat/completions, /v1/completions and /v1/models on this HTTP "
        f"port, through smg (needs `{INSTALL_HINT}`; $PAGEDSERVE_OPENAI_PORT; 0: off)",
    )
    group.add_argument(
        "--openai-host", default=None, help="the OpenAI API's interface (default: --host)"
    )


def add_gateway_command(commands: argparse._SubParsersAction) -> None:
    """`pagedserve gateway`. Its flags keep the `dest` names of `serve`'s, so `serve` starts
    it with `flags_from` like its other children."""
    gateway = commands.add_parser(
        "gateway", help="the OpenAI-compatible HTTP API (smg) in front of engine replicas"
    )
    gateway.add_argument(
        "--engine-addr",
        default=os.environ.get("PAGEDSERVE_ENGINE_ADDR") or "127.0.0.1:50052",
        help="engine replicas: comma-separated host:port and dns:///name:port (every "
        "address behind the name, re-resolved every --dns-refresh seconds)",
    )
    gateway.add_argument("--host", dest="openai_host", default="0.0.0.0")
    gateway.add_argument("--port", dest="openai_port", type=int, default=DEFAULT_GATEWAY_PORT)
    gateway.add_argument(
        "--policy", choices=POLICIES, default="cache_aware", help="smg's routing (cache_aware)"
    )
    gateway.add_argument(
        "--metrics-port",
        dest="gateway_metrics_port",
        type=int,
        default=0,
        help="smg's Prometheus /metrics on --host (0: a free loopback port)",
    )
    gateway.add_argument("--dns-refresh", type=float, default=5.0, help="seconds (5)")
    gateway.add_argument(
        "--shutdown-grace", type=float, default=10.0, help="seconds for streams after SIGTERM"
    )
    gateway.add_argument("--log-level", default=os.environ.get("PAGEDSERVE_LOG_LEVEL", "INFO"))
    gateway.add_argument("--log-format", choices=("text", "json"), default="text")


# ---- finding smg ------------------------------------------------------------------------


def find_smg() -> str | None:
    """The `smg` executable: $PAGEDSERVE_SMG, else beside this Python (a virtual
    environment that is not activated), else on PATH."""
    explicit = os.environ.get(SMG_ENV)
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    beside = Path(sys.executable).with_name("smg")
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("smg")


def serve_refusal(ns: argparse.Namespace) -> str | None:
    """Why `serve --openai-port` cannot start, checked before anything starts."""
    if find_smg() is None:
        where = (
            f" ${SMG_ENV} is {os.environ[SMG_ENV]!r}, not an executable;"
            if (os.environ.get(SMG_ENV))
            else ""
        )
        return (
            f"--openai-port needs the smg gateway, which is not installed:{where} run "
            f"`{INSTALL_HINT}` (or `pip install smg`)"
        )
    if ns.api_key_file or ns.tls_cert_file:
        return (
            "--openai-port cannot be combined with --api-key-file or TLS: the gateway would "
            "answer without checking them; run `pagedserve gateway` with smg's own --api-key "
            "and TLS flags instead (docs/deployment.md)"
        )
    return None


# ---- the worker manifest ------------------------------------------------------------------


def engine_addresses(spec: str) -> list[str]:
    """Every engine address `spec` names now: its fixed entries and each `dns:///` name's
    addresses (none while a name does not resolve, as before its replicas start)."""
    from services.tokenizer_service.replicas.pool import format_address, parse_engine_addresses

    fixed, names = parse_engine_addresses(spec)
    found = list(fixed)
    for host, port in names:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            logger.info("engine name does not resolve yet", extra={"name": host, "error": exc})
            continue
        found += sorted({format_address(info[4][0], port) for info in infos})
    return found


def serving_addresses(
    addresses: list[str], previous: list[str], *, timeout: float = 2.0
) -> list[str]:
    """The addresses whose engine reports SERVING on gRPC health. smg registers a worker
    once, asking it for its model and tokenizer at that moment: a replica still loading (a
    new `--scale` replica, a restarted one) would stay registered as model "unknown" that
    answers 503, and a draining one must stop receiving work. So only serving replicas go in
    the manifest. A health check that times out (a busy replica) keeps the address's previous
    state rather than making the worker flap."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    serving = []
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=timeout
                )
                ok = reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError as exc:
                ok = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and address in previous
        if ok:
            serving.append(address)
    return serving


def write_manifest(path: Path, addresses: list[str]) -> None:
    """smg's file discovery manifest, replaced atomically (smg rereads it when it changes)."""
    body = {"version": 1, "workers": [{"url": f"grpc://{a}"} for a in addresses]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    os.replace(tmp, path)


# ---- running smg --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def smg_argv(smg: str, ns: argparse.Namespace, manifest: Path) -> list[str]:
    metrics_host = ns.openai_host if ns.gateway_metrics_port else "127.0.0.1"
    argv = [smg, "launch", "--backend", "vllm", "--policy", ns.policy]
    argv += ["--discovery-provider", "file", "--discovery-file", str(manifest)]
    argv += ["--host", ns.openai_host, "--port", str(ns.openai_port)]
    argv += ["--prometheus-host", metrics_host]
    argv += ["--prometheus-port", str(ns.gateway_metrics_port or _free_port())]
    argv += ["--shutdown-grace-period-secs", str(max(1, round(ns.shutdown_grace)))]
    return [*argv, "--log-level", _SMG_LOG_LEVELS.get(ns.log_level.upper(), "info")]


def _die_with_parent() -> None:
    """In the smg child: SIGTERM when this process dies, however it dies (no orphan)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_gateway(ns: argparse.Namespace) -> int:
    """`pagedserve gateway`: smg as a child, its manifest kept up to date, until SIGTERM /
    SIGINT (forwarded) or smg exits (its exit status is returned)."""
    smg = find_smg()
    if smg is None:
        logger.error(f"the smg gateway is not installed: run `{INSTALL_HINT}`")
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="pagedserve-gateway-") as tmp:
        manifest = Path(tmp) / "workers.json"
        addresses = serving_addresses(engine_addresses(ns.engine_addr), [])
        write_manifest(manifest, addresses)
        argv = smg_argv(smg, ns, manifest)
        proc = subprocess.Popen(argv, preexec_fn=_die_with_parent)
        logger.info("smg started", extra={"pid": proc.pid, "workers": addresses})
        while not stop.wait(ns.dns_refresh) and proc.poll() is None:
            now = serving_addresses(engine_addresses(ns.engine_addr), addresses)
            if now != addresses:
                logger.info("engine replicas changed", extra={"workers": now})
                write_manifest(manifest, now)
                addresses = now
        if proc.poll() is not None:
            logger.error("smg exited", extra={"code": proc.returncode})
            return proc.returncode or 1
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(ns.shutdown_grace + 10.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return 0


def wait_until_ready(
    url: str, children: list[subprocess.Popen], timeout: float, *, poll_s: float = 0.25
) -> bool:
    """Polls smg's `/readiness` at `url` until it reports a healthy worker; False if a
    child exits or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(child.poll() is not None for child in children):
            return False
        try:
            with urllib.request.urlopen(f"{url}/readiness", timeout=2) as reply:
                if json.loads(reply.read()).get("healthy_workers", 0) > 0:
                    return True
        except (OSError, ValueError, urllib.error.URLError):
            pass
        time.sleep(poll_s)
    return False
