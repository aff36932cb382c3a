"""A development certificate authority for TLS between all hops (docs/deployment.md).

    python scripts/dev_ca.py certs/              # ca.pem, tokenizer.*, engine.*, client.*
    python scripts/dev_ca.py certs/ --days 30 --name tokenizer.example.com
    python scripts/dev_ca.py certs/ --key-mode 644   # for the compose stack (see below)

Writes, under the folder:

    ca.pem / ca-key.pem           the CA (keep ca-key.pem off the servers)
    tokenizer.pem / -key.pem      the public API's server certificate; also the tokenizer
                                  service's client certificate towards the engine (mTLS)
    engine.pem / -key.pem         the engine API's server certificate
    client.pem / -key.pem         a client certificate for callers of the public API (mTLS)

Every certificate names `localhost` and 127.0.0.1, the compose service name, and any
`--name`. For development and tests only: a production deployment gets its certificates
from its own PKI (cert-manager, Vault, an ACME CA...). Needs `cryptography` (dev extra).

The keys are readable by their owner only (0600), unless `--key-mode` says otherwise. The
images run as the user `pagedserve` (uid 10001), which cannot read a 0600 key owned by you
through a bind mount, so docker/compose.secure.yml's quick start writes them with 644.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_DAY = datetime.timedelta(days=1)
_CA_KEY_USAGE = x509.KeyUsage(
    digital_signature=True,
    key_cert_sign=True,
    crl_sign=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    encipher_only=False,
    decipher_only=False,
)


@dataclass(frozen=True)
class Issued:
    """A key and its certificate (and, for a CA, what it signs with)."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def write(self, folder: Path, name: str, key_mode: int = 0o600) -> tuple[Path, Path]:
        """`<name>.pem` and `<name>-key.pem` (the key readable by its owner only, unless
        `key_mode` says otherwise)."""
        cert_path, key_path = folder / f"{name}.pem", folder / f"{name}-key.pem"
        cert_path.write_bytes(self.cert_pem)
        key_path.write_bytes(self.key_pem)
        os.chmod(key_path, key_mode)
        return cert_path, key_path


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pagedserve development"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def make_ca(common_name: str = "pagedserve development CA", days: int = 365) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _DAY)
        .not_valid_after(now + days * _DAY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_KEY_USAGE, critical=True)
        .sign(key, hashes.SHA256())
    )
    return Issued(key, cert)


def issue(
    ca: Issued,
    common_name: str,
    names: list[str] | None = None,
    *,
    days: int = 365,
    expired: bool = False,
) -> Issued:
    """A certificate for `common_name` and `names` (DNS names or IP addresses), good for
    both TLS servers and clients; `expired=True` makes one that ended yesterday."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = (now - 10 * _DAY, now - _DAY) if expired else (now - _DAY, now + days * _DAY)
    alt_names: list[x509.GeneralName] = []
    for name in dict.fromkeys([common_name, *(names or [])]):
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt_names.append(x509.DNSName(name))
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    return Issued(key, cert)


def make_dev_pki(
    folder: Path, extra_names: list[str], days: int, key_mode: int = 0o600
) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    ca = make_ca(days=days)
    written = list(ca.write(folder, "ca"))  # the CA's key stays the owner's alone
    local = ["localhost", "127.0.0.1", "::1", *extra_names]
    for service in ("tokenizer", "engine", "client"):
        written += issue(ca, service, local, days=days).write(folder, service, key_mode)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--name", action="append", default=[], help="another DNS name or IP")
    parser.add_argument(
        "--key-mode",
        type=lambda text: int(text, 8),
        default=0o600,
        help="octal mode of the service keys (600); 644 lets the containers' user read them",
    )
    ns = parser.parse_args()
    for path in make_dev_pki(ns.folder, ns.name, ns.days, ns.key_mode):
        print(path)


if __name__ == "__main__":
    main()
