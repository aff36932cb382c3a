"""`pagedserve serve`: both services as child processes, for a laptop.

Starts the engine and tokenizer services (each in its own session, so only this process
decides when they stop), waits until the public API reports SERVING, streams a demo chat
answer through it, then serves until Ctrl-C / SIGTERM, which it forwards as SIGTERM: the
tokenizer service first (its streams finish or abort within the grace period), then the
engine service. If either child dies, the other is stopped and the command fails.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.chat import stream_chat
from services.cli import flags_from, subparser

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


def wait_until_serving(address: str, children: list[subprocess.Popen], timeout: float) -> bool:
    """Polls the standard health service at `address` until SERVING; False if a child
    exits or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    request = health_pb2.HealthCheckRequest(service="")
    with grpc.insecure_channel(address) as channel:
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


def _demo(address: str, prompt: str, max_tokens: int) -> None:
    print(f"> {prompt}\n", flush=True)
    start = time.perf_counter()
    answer = stream_chat(address, prompt, max_tokens=max_tokens)
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


def serve(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    children: list[subprocess.Popen] = []
    address = _client_address(ns.host, ns.port)
    try:
        children.append(_spawn("engine", ns, parser))
        children.append(_spawn("tokenizer", ns, parser))
        if not wait_until_serving(address, children, ns.startup_timeout):
            logger.error("the services did not become healthy", extra={"address": address})
            return 1
        print(
            f"[ready: public API on {ns.host}:{ns.port}, engine API on {ns.engine_addr}]",
            file=sys.stderr,
            flush=True,
        )
        if ns.prompt:
            _demo(address, ns.prompt, ns.max_tokens)
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
        try:
            _stop(children, ns.shutdown_grace)
        finally:
            signal.signal(signal.SIGTERM, previous)
