"""`pagedserve serve`: both services as child processes, for a laptop.

Starts the engine and tokenizer services (each in its own session, so only this process
decides when they stop), waits until the public API reports SERVING, streams a demo chat
answer through it, then serves until Ctrl-C / SIGTERM, which it forwards as SIGTERM: the
tokenizer service first (its streams finish or abort within the grace period), then the
engine service. If either child dies, the other is stopped and the command fails.

With `--openai-port`, a third child, `pagedserve gateway` (services/cli/openai_gateway.py:
the smg gateway, OpenAI's HTTP API), starts once the engine is SERVING, is ready before
`serve` says so, and is stopped first. Without smg installed, nothing starts at all.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.channel import ChannelConfig
from clients.chat import stream_chat
from services.cli import openai_gateway
from services.cli.flags import flags_from, subparser

logger = logging.getLogger("services.serve")

_POLL_S = 0.25


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # one way out for Ctrl-C and SIGTERM alike


def _spawn(command: str, ns: argparse.Namespace, parser: argparse.ArgumentParser):
    argv = [sys.executable, "-m", "services", command]
    argv += flags_from(ns, subparser(parser, command))
    return subprocess.Popen(argv, start_new_session=True)


def _client_address(host: str, port: int) -> str:
    return f"127.0.0.1:{port}" if host in ("0.0.0.0", "::", "") else f"{host}:{port}"


def link_tls_defaults(ns: argparse.Namespace) -> None:
    """One set of TLS flags for both hops: with `--tls-cert-file`, the tokenizer service
    verifies the engine against `--tls-client-ca-file` (else the certificate itself, when it
    is self-signed) and, for mutual TLS, shows the same certificate as its client one.
    `--engine-tls-*` flags given explicitly win."""
    if not ns.tls_cert_file:
        return
    if not ns.engine_tls_ca_file:
        ns.engine_tls_ca_file = ns.tls_client_ca_file or ns.tls_cert_file
    if ns.tls_client_ca_file and not ns.engine_tls_cert_file:
        ns.engine_tls_cert_file, ns.engine_tls_key_file = ns.tls_cert_file, ns.tls_key_file


def client_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """How this command's own calls (health, the demo) reach the public API: the same
    trust as the engine link, and the demo's API key."""
    if not ns.tls_cert_file:
        return {"api_key": ns.api_key}
    kwargs: dict[str, Any] = {"root_certificates": ns.engine_tls_ca_file, "api_key": ns.api_key}
    if ns.tls_client_ca_file:
        kwargs.update(private_key=ns.tls_key_file, certificate_chain=ns.tls_cert_file)
    return kwargs


def _health_channel(address: str, tls: dict[str, Any]) -> grpc.Channel:
    if tls.get("root_certificates") is None:
        return grpc.insecure_channel(address)
    return ChannelConfig(
        address=address,
        root_certificates=tls["root_certificates"],
        private_key=tls.get("private_key"),
        certificate_chain=tls.get("certificate_chain"),
    ).sync_channel()


def wait_until_serving(
    address: str,
    children: list[subprocess.Popen],
    timeout: float,
    tls: dict[str, Any] | None = None,
) -> bool:
    """Polls the standard health service at `address` until SERVING; False if a child
    exits or `timeout` passes first. `tls`: `client_kwargs` (None: plaintext)."""
    deadline = time.monotonic() + timeout
    request = health_pb2.HealthCheckRequest(service="")
    with _health_channel(address, tls or {}) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if any(child.poll() is not None for child in children):
                return False
            try:
                reply = stub.Check(request, timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(_POLL_S)
    return False


def _demo(address: str, prompt: str, max_tokens: int, client: dict[str, Any]) -> None:
    print(f"> {prompt}\n", flush=True)
    start = time.perf_counter()
    answer = stream_chat(address, prompt, max_tokens=max_tokens, **client)
    elapsed = time.perf_counter() - start
    print(
        f"\n\n[{answer.num_tokens} tokens in {elapsed:.2f}s through the public API, "
        f"finish_reason={answer.finish_reason}]",
        file=sys.stderr,
        flush=True,
    )


def _stop(children: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM to each child in turn (tokenizer first), then SIGKILL after the grace."""
    for child in reversed(children):
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(grace + 10.0)
            except subprocess.TimeoutExpired:
                logger.warning("child did not stop in time; killing it", extra={"pid": child.pid})
                child.kill()
                child.wait()


def _start_gateway(
    ns: argparse.Namespace, parser: argparse.ArgumentParser, children: list[subprocess.Popen]
) -> str | None:
    """The OpenAI API's base URL once smg is ready; None if it failed to get there."""
    ns.openai_host = ns.openai_host or ns.host
    children.append(_spawn("gateway", ns, parser))
    host = _client_address(ns.openai_host, ns.openai_port).rpartition(":")[0]
    if not openai_gateway.wait_until_ready(
        f"http://{host}:{ns.openai_port}", children, ns.startup_timeout
    ):
        logger.error("the OpenAI API gateway did not become ready", extra={"port": ns.openai_port})
        return None
    return f"http://{ns.openai_host}:{ns.openai_port}/v1"


def serve(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if ns.openai_port and (refusal := openai_gateway.serve_refusal(ns)):
        logger.error(refusal)
        return 2
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    children: list[subprocess.Popen] = []
    address = _client_address(ns.host, ns.port)
    link_tls_defaults(ns)
    client = client_kwargs(ns)
    try:
        children.append(_spawn("engine", ns, parser))
        children.append(_spawn("tokenizer", ns, parser))
        if not wait_until_serving(address, children, ns.startup_timeout, client):
            logger.error("the services did not become healthy", extra={"address": address})
            return 1
        openai = ""
        if ns.openai_port:
            if (url := _start_gateway(ns, parser, children)) is None:
                return 1
            openai = f", OpenAI API on {url}"
        print(
            f"[ready: public API on {ns.host}:{ns.port}, engine API on {ns.engine_addr}{openai}]",
            file=sys.stderr,
            flush=True,
        )
        if ns.prompt and ns.api_key_file and not ns.api_key:
            print("[no demo: API keys are on; give --api-key]", file=sys.stderr, flush=True)
        elif ns.prompt:
            _demo(address, ns.prompt, ns.max_tokens, client)
        if ns.demo:
            return 0
        print(f"Serving the public API on {ns.host}:{ns.port}; Ctrl-C to stop.", file=sys.stderr)
        while all(child.poll() is None for child in children):
            time.sleep(_POLL_S)
        logger.error("a service exited", extra={"codes": [c.poll() for c in children]})
        return 1
    except KeyboardInterrupt:
        logger.info("stopping")
        return 0
    finally:
        # A second SIGTERM or Ctrl-C (a process-group kill, an impatient user) must not cut
        # the stopping short: that would leave the children running. `_stop` is bounded
        # anyway (SIGKILL after the grace).
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            _stop(children, ns.shutdown_grace)
        finally:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
