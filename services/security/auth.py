"""API keys and tenants of the public API (`--api-key-file`).

The key file has one key per line, whitespace-separated:

    <key> <tenant> [admin] [max_streams=N] [rps=R] [weight=W]     # a comment

`weight` is the tenant's share of an engine's batch against the other tenants (a positive
number, default 1): the engine serves a tenant of weight 2 twice the tokens of one of
weight 1 while both have requests waiting (docs/engine.md, fair sharing).

A key alone is its own tenant, without limits, named by its fingerprint (`key-` and the
first 12 hex digits of its SHA-256), so that a name exists for logs and metrics without
the key. Several keys may share a tenant (rotation); the tenant's limits and weight are
given once, or identically. `admin` belongs to the key.

Keys are kept only as HMAC-SHA-256 digests under a random per-process secret, and a lookup
compares the presented key's digest with every stored one in constant time, so neither
timing nor a memory dump of the server gives a key away. Keys are never logged: errors
about the file name the line, not the key.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

from services.common.errors import ConfigError
from services.security.caller import Principal, Tenant

_TENANT_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
_MIN_KEY_CHARS = 16


def fingerprint(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


class ApiKeys:
    """The configured keys, hashed; `authenticate` maps a presented key to its caller."""

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(32)
        self._entries: list[tuple[bytes, str, bool]] = []  # (digest, tenant name, admin)
        self.tenants: dict[str, Tenant] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _digest(self, key: str) -> bytes:
        return hmac.new(self._secret, key.encode("utf-8", "replace"), hashlib.sha256).digest()

    def add(self, key: str, tenant: Tenant, admin: bool = False) -> None:
        if len(key) < _MIN_KEY_CHARS:
            raise ValueError(f"an API key must have at least {_MIN_KEY_CHARS} characters")
        digest = self._digest(key)
        if self._find(digest) is not None:
            raise ValueError("the same API key appears twice")
        known = self.tenants.get(tenant.name)
        unset = (None, None, None)
        limits, known_limits = _limits(tenant), _limits(known) if known is not None else unset
        if limits != unset and known_limits not in (unset, limits):
            raise ValueError(f"tenant {tenant.name!r} is given two different limits or weights")
        if known is None or limits != unset:
            self.tenants[tenant.name] = tenant
        self._entries.append((digest, tenant.name, admin))

    def _find(self, digest: bytes) -> Principal | None:
        found = None
        for stored, name, admin in self._entries:  # no early exit: constant time
            if hmac.compare_digest(stored, digest):
                found = Principal(self.tenants[name], admin)
        return found

    def authenticate(self, key: str) -> Principal | None:
        """The caller the key belongs to, or None."""
        return self._find(self._digest(key))

    @classmethod
    def from_file(cls, path: str) -> ApiKeys:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ConfigError(f"--api-key-file: cannot read {path!r}: {exc.strerror}") from None
        return cls.parse(text, source=path)

    @classmethod
    def parse(cls, text: str, source: str = "<keys>") -> ApiKeys:
        keys = cls()
        for number, line in enumerate(text.splitlines(), start=1):
            fields = _strip_comment(line).split()
            if not fields:
                continue
            try:
                key, tenant, admin = _parse_fields(fields)
                keys.add(key, tenant, admin)
            except ValueError as exc:
                raise ConfigError(f"{source}:{number}: {exc}") from None
        if not keys:
            raise ConfigError(
                f"{source}: no API keys (an empty key file would lock every caller out)"
            )
        return keys


def _limits(tenant: Tenant) -> tuple[int | None, float | None, float | None]:
    """What a key line may set for its tenant; None where it is left at its default."""
    return tenant.max_streams, tenant.rps, tenant.weight if tenant.weight != 1.0 else None


def _strip_comment(line: str) -> str:
    """`#` starts a comment at the start of a line or after whitespace (keys may hold #)."""
    match = re.search(r"(^|\s)#", line)
    return line if match is None else line[: match.start()]


def _parse_fields(fields: list[str]) -> tuple[str, Tenant, bool]:
    key, rest = fields[0], fields[1:]
    if not rest:
        return key, Tenant(fingerprint(key)), False
    name, options = rest[0], rest[1:]
    if not _TENANT_NAME.fullmatch(name):
        raise ValueError(f"tenant name {name!r} must match {_TENANT_NAME.pattern}")
    admin, max_streams, rps, weight = False, None, None, 1.0
    for option in options:
        option_name, eq, value = option.partition("=")
        if option == "admin":
            admin = True
        elif option_name == "max_streams" and eq:
            max_streams = _positive(option_name, value, int)
        elif option_name == "rps" and eq:
            rps = _positive(option_name, value, float)
        elif option_name == "weight" and eq:
            weight = _positive(option_name, value, float)
        else:
            raise ValueError(
                f"unknown option {option!r} (expected admin, max_streams=N, rps=R or weight=W)"
            )
    return key, Tenant(name, int(max_streams) if max_streams else None, rps, weight), admin


def _positive(name: str, value: str, kind: type) -> float:
    try:
        number = kind(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None
    if not number > 0 or number != number or number == float("inf"):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return number
