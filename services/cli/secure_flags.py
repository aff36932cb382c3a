"""The `pagedserve` flags of security and request cost: TLS of each server, the tokenizer
service's TLS to the engine, API keys, and what one request may cost. Each TLS / key flag
also reads a `PAGEDSERVE_` variable of the same name (`--tls-cert-file` ↔
`PAGEDSERVE_TLS_CERT_FILE`). See docs/deployment.md ("Secure deployment")."""

from __future__ import annotations

import argparse
import os
from typing import Any

_SERVER_TLS_FLAGS = (
    ("--tls-cert-file", "the server's certificate chain (PEM): TLS on"),
    ("--tls-key-file", "the server's private key (PEM)"),
    ("--tls-client-ca-file", "CA for client certificates: mutual TLS, certificates required"),
)
_ENGINE_LINK_FLAGS = (
    ("--engine-tls-ca-file", "CA to verify the engine (TLS to the engine on)"),
    ("--engine-tls-cert-file", "our client certificate for the engine (mTLS)"),
    ("--engine-tls-key-file", "its private key"),
    ("--engine-tls-server-name", "the name checked in the engine's certificate"),
)
_LIMITS = (
    ("max_prompt_bytes", "UTF-8 bytes of a prompt text / chat"),
    ("max_chat_messages", "messages of a chat"),
    ("max_n", "sampling_params.n"),
    ("max_stop_strings", "sampling_params.stop entries"),
    ("max_stop_string_bytes", "bytes of one stop string"),
    ("max_encode_inputs", "texts + token_ids of one Encode"),
)


def _env_flag(group: argparse._ArgumentGroup, flag: str, help_text: str) -> None:
    env = "PAGEDSERVE_" + flag[2:].replace("-", "_").upper()
    # An empty value counts as unset (compose files often set "").
    group.add_argument(flag, default=os.environ.get(env) or None, help=f"{help_text} (${env})")


def add_security_args(parser: argparse.ArgumentParser, command: str) -> None:
    """`command`: serve, engine or tokenizer (serve gets the engine's and the tokenizer's)."""
    group = parser.add_argument_group("TLS and API keys (docs/deployment.md)")
    for flag, help_text in _SERVER_TLS_FLAGS:
        _env_flag(group, flag, help_text)
    if command == "engine":
        group.add_argument(
            "--allow-insecure-engine",
            action="store_true",
            default=bool(os.environ.get("PAGEDSERVE_ALLOW_INSECURE_ENGINE")),
            help="let the engine API listen without TLS on a non-loopback address",
        )
    if command not in ("serve", "tokenizer"):
        return
    for flag, help_text in _ENGINE_LINK_FLAGS:
        _env_flag(group, flag, help_text)
    _env_flag(group, "--api-key-file", "'<key> <tenant> [admin] [max_streams=N] [rps=R]' lines")
    from services.tokenizer_service.request_limits import RequestLimits

    limits = RequestLimits()
    costs = parser.add_argument_group("what one request may cost (docs/grpc.md)")
    for name, help_text in _LIMITS:
        default = getattr(limits, name)
        flag = "--" + name.replace("_", "-")
        costs.add_argument(flag, type=int, default=default, help=f"{help_text} ({default})")


def server_tls_from(ns: argparse.Namespace) -> Any:
    from services.security.tls import ServerTLSConfig

    return ServerTLSConfig.from_flags(ns.tls_cert_file, ns.tls_key_file, ns.tls_client_ca_file)


def engine_link_tls_from(ns: argparse.Namespace) -> Any:
    from services.security.tls import EngineLinkTLS

    return EngineLinkTLS(
        ns.engine_tls_ca_file,
        ns.engine_tls_cert_file,
        ns.engine_tls_key_file,
        ns.engine_tls_server_name,
    )


def request_limits_from(ns: argparse.Namespace) -> Any:
    from services.tokenizer_service.request_limits import RequestLimits

    return RequestLimits(**{name: getattr(ns, name) for name, _ in _LIMITS})
