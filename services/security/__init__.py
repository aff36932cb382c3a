"""Security of both services: API keys and tenants (auth), the guard that applies them and the
per-tenant limits (tenancy), the caller of the RPC being served, and TLS for both hops.
The engine never sees keys."""
