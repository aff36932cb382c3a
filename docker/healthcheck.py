"""A gRPC health probe for container health checks (grpc.health.v1, the standard protocol).

    python healthcheck.py ADDRESS [SERVICE]

Asks the server at ADDRESS (host:port) for the health of SERVICE (default "": the whole
server) and exits 0 only when the answer is SERVING; 1 on NOT_SERVING, UNKNOWN, an RPC error
or a timeout; 2 on bad usage. One line on stdout (or stderr) says why. The timeout is
$HEALTHCHECK_TIMEOUT seconds (default 3); keep it below the container's health-check timeout.

TLS: $HEALTHCHECK_CA_FILE (the CA that signed the server's certificate) turns it on;
$HEALTHCHECK_CERT_FILE / $HEALTHCHECK_KEY_FILE add a client certificate (a server with
mutual TLS); $HEALTHCHECK_SERVER_NAME overrides the name checked (default: ADDRESS's host).

It needs only grpcio and grpcio-health-checking (dependencies of pagedserve), so it also works
from any machine with those installed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

USAGE = "usage: healthcheck.py ADDRESS [SERVICE]  (exit 0 only when SERVING)"


def _read(variable: str) -> bytes | None:
    path = os.environ.get(variable)
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def _channel(grpc, address: str):
    """Plaintext, or TLS when $HEALTHCHECK_CA_FILE is set (see the module docstring)."""
    ca = _read("HEALTHCHECK_CA_FILE")
    if ca is None:
        return grpc.insecure_channel(address)
    credentials = grpc.ssl_channel_credentials(
        ca, _read("HEALTHCHECK_KEY_FILE"), _read("HEALTHCHECK_CERT_FILE")
    )
    name = os.environ.get("HEALTHCHECK_SERVER_NAME")
    options = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(address, credentials, options)


def probe(address: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """(serving, a one-line explanation) for `service` at `address`."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with _channel(grpc, address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: Sequence[str]) -> int:
    if not 1 <= len(argv) <= 2 or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 2
    address, service = argv[0], argv[1] if len(argv) == 2 else ""
    try:
        timeout = float(os.environ.get("HEALTHCHECK_TIMEOUT", "3"))
    except ValueError:
        print(f"HEALTHCHECK_TIMEOUT is not a number; {USAGE}", file=sys.stderr)
        return 2
    serving, why = probe(address, service, timeout)
    target = f"{address} {service!r}" if service else address
    print(f"{target}: {why}", file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
