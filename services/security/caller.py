"""The caller of the RPC being served: its tenant (API keys on) and what follows from it.

`services.security.tenancy.TenantGuard` sets `current_principal` for the duration of an accepted
call; the servicers, spans and logs read the tenant from it. The key is never part of it.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request belongs to, and what it may use."""

    name: str
    max_streams: int | None = None  # concurrent Generate / Encode streams
    rps: float | None = None  # requests per second (a token bucket, burst = one second)
    # Its share of an engine's batch against the other tenants (the engine's fair sharing,
    # engine/core/fairness.py): weight 2 is served twice the tokens of weight 1.
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller: its tenant and whether its key is an admin key."""

    tenant: Tenant
    admin: bool = False


# The caller of the RPC being served (set by `services.security.tenancy.TenantGuard`); None when
# the server runs without keys.
current_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "current_principal", default=None
)


def current_tenant_name() -> str | None:
    principal = current_principal.get()
    return principal.tenant.name if principal is not None else None


def fairness_fields() -> dict[str, object]:
    """The internal engine request's fairness fields for the caller: its tenant and the
    tenant's weight (API keys on), else the engine's default key."""
    principal = current_principal.get()
    if principal is None:
        return {"fairness_key": "", "fairness_weight": 0.0}  # 0: the engine's default, 1
    return {"fairness_key": principal.tenant.name, "fairness_weight": principal.tenant.weight}


def scoped_request_id(request_id: str) -> str:
    """The id a request has inside the servers: the tenant's name first, so two tenants may
    use the same id and neither can reach the other's requests ("/" cannot appear in a
    tenant name, so the scope ends at the first one)."""
    tenant = current_tenant_name()
    return request_id if tenant is None else f"{tenant}/{request_id}"
