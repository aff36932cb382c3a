"""Flags every client command shares: where the server is and how to connect."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from clients.channel import DEFAULT_ADDRESS


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--address",
        default=os.environ.get("PAGEDSERVE_ADDRESS", DEFAULT_ADDRESS),
        help=f"the public API's host:port ($PAGEDSERVE_ADDRESS; {DEFAULT_ADDRESS})",
    )
    group.add_argument("--tls", action="store_true", help="connect with TLS (system roots)")
    group.add_argument("--root-certificates", metavar="PEM", help="CA file to verify the server")
    group.add_argument("--private-key", metavar="PEM", help="client key (mutual TLS)")
    group.add_argument("--certificate-chain", metavar="PEM", help="client certificate (mTLS)")
    group.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDSERVE_API_KEY") or None,
        help="sent as 'authorization: Bearer <key>' ($PAGEDSERVE_API_KEY)",
    )


def connection_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """`Client` / `AsyncClient` keyword arguments from the connection flags."""
    return {
        "address": ns.address,
        "tls": ns.tls,
        "root_certificates": ns.root_certificates,
        "private_key": ns.private_key,
        "certificate_chain": ns.certificate_chain,
        "api_key": ns.api_key,
    }


def print_error(exc: BaseException) -> None:
    print(f"error: {exc}", file=sys.stderr, flush=True)
