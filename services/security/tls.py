"""TLS for both hops: the servers' credentials (re-read on SIGHUP) and the tokenizer
service's client credentials for its link to the engines.

    client ──TLS/mTLS──▶ tokenizer service ──TLS/mTLS──▶ engine service
            ServerTLS (--tls-*)          EngineLinkTLS (--engine-tls-*)   ServerTLS (--tls-*)

A server's certificate and key (and, for mTLS, the CA that signs client certificates) are
files. `ServerTLS.reload()` reads them again; gRPC asks for the new configuration at the
next handshake through its certificate-configuration fetcher, so connections (and their
streams) that are already open carry on with the old certificate and new ones get the new
one. A reload that fails (a missing or half-written file) keeps the old certificate.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import grpc

from services.common.errors import ConfigError

logger = logging.getLogger("services.security.tls")


def read_file(path: str | os.PathLike[str], what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {os.fspath(path)!r}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ConfigError(f"{what}: {os.fspath(path)!r} is not a PEM file")
    return data


@dataclass(frozen=True, slots=True)
class ServerTLSConfig:
    """A server's `--tls-cert-file`, `--tls-key-file` and `--tls-client-ca-file` (mTLS:
    client certificates are required and verified against this CA)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    @classmethod
    def from_flags(
        cls, cert_file: str | None, key_file: str | None, client_ca_file: str | None
    ) -> ServerTLSConfig | None:
        """None when TLS is off; both the certificate and the key, or neither."""
        if not cert_file and not key_file:
            if client_ca_file:
                raise ConfigError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
            return None
        if not cert_file or not key_file:
            raise ConfigError("--tls-cert-file and --tls-key-file go together")
        return cls(cert_file, key_file, client_ca_file or None)


class ServerTLS:
    """The server credentials of one server, with `reload()` for certificate rotation."""

    def __init__(self, config: ServerTLSConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._pending: Any = None  # a configuration the next handshake picks up
        self._initial = self._read()
        self.num_reloads = 0

    @property
    def mutual(self) -> bool:
        return self.config.client_ca_file is not None

    def _read(self) -> Any:
        c = self.config
        pair = (read_file(c.key_file, "tls key"), read_file(c.cert_file, "tls certificate"))
        roots = read_file(c.client_ca_file, "tls client CA") if c.client_ca_file else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=roots)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self._fetch, require_client_authentication=self.mutual
        )

    def _fetch(self) -> Any:
        """Called by gRPC (from its own thread) before each handshake: a new configuration
        once after a reload, else None (keep the current one)."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def reload(self) -> bool:
        """Reads the files again; new handshakes use them. False (old certificate kept,
        one log line) when they cannot be read."""
        try:
            config = self._read()
        except ConfigError as exc:
            logger.error("tls reload failed; keeping the current certificate: %s", exc)
            return False
        with self._lock:
            self._pending = config
        self.num_reloads += 1
        logger.info("tls certificates reloaded", extra={"cert_file": self.config.cert_file})
        return True


@dataclass(frozen=True, slots=True)
class EngineLinkTLS:
    """The tokenizer service's TLS to its engines: `--engine-tls-ca-file` (verify the
    engine; TLS is on when it or the client certificate is given),
    `--engine-tls-cert-file` / `--engine-tls-key-file` (our client certificate, for mTLS),
    `--engine-tls-server-name` (the name checked against the engine's certificate, when
    it differs from the host in the address)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError("--engine-tls-cert-file and --engine-tls-key-file go together")
        if self.server_name and not self.enabled:
            raise ConfigError("--engine-tls-server-name needs --engine-tls-ca-file")

    @property
    def enabled(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    def credentials(self) -> grpc.ChannelCredentials:
        ca = read_file(self.ca_file, "engine tls CA") if self.ca_file else None
        key = read_file(self.key_file, "engine tls key") if self.key_file else None
        cert = read_file(self.cert_file, "engine tls certificate") if self.cert_file else None
        return grpc.ssl_channel_credentials(ca, key, cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        if not self.server_name:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def is_loopback(address: str) -> bool:
    """Whether host:port names this machine only (localhost, 127.0.0.0/8, ::1)."""
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name (or 0.0.0.0 / [::]) may be reached from elsewhere
