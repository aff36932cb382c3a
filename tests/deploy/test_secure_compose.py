"""docker/compose.secure.yml: TLS on every hop (certificates from a mounted folder), API
keys from a Docker secret, the engine never published; the health probe speaks (m)TLS."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.cli.flags import build_parser, subparser
from tests.deploy.test_compose import COMPOSE_FILE, PROBE, ROOT, _config, _run_compose
from tests.services.secure import make_pki

SECURE_OVERRIDE = ROOT / "docker" / "compose.secure.yml"


@pytest.fixture(scope="module")
def services() -> dict:
    return _config(COMPOSE_FILE, SECURE_OVERRIDE)["services"]


def test_secure_override_is_valid() -> None:
    result = _run_compose("-f", str(COMPOSE_FILE), "-f", str(SECURE_OVERRIDE), "config", "-q")
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_the_base_file_is_plaintext_only_by_saying_so() -> None:
    engine = _config(COMPOSE_FILE)["services"]["engine"]
    assert "--allow-insecure-engine" in engine["command"]


def test_every_hop_has_tls_and_the_engine_is_internal(services: dict) -> None:
    engine, tokenizer = services["engine"], services["tokenizer"]
    assert "--allow-insecure-engine" not in engine["command"]
    assert not engine.get("ports")  # never published
    env = engine["environment"]
    assert env["PAGEDSERVE_TLS_CERT_FILE"] == "/certs/engine.pem"
    assert env["PAGEDSERVE_TLS_CLIENT_CA_FILE"] == "/certs/ca.pem"  # mutual TLS
    tok_env = tokenizer["environment"]
    assert tok_env["PAGEDSERVE_TLS_CERT_FILE"] == "/certs/tokenizer.pem"
    assert tok_env["PAGEDSERVE_ENGINE_TLS_CA_FILE"] == "/certs/ca.pem"
    assert tok_env["PAGEDSERVE_ENGINE_TLS_CERT_FILE"] == "/certs/tokenizer.pem"
    for service in (engine, tokenizer):
        (mount,) = service["volumes"]
        assert mount["target"] == "/certs" and mount["read_only"]
        assert service["environment"]["HEALTHCHECK_CA_FILE"] == "/certs/ca.pem"


def test_the_unchecked_openai_gateway_is_off(services: dict) -> None:
    """smg checks neither the API keys nor the engine's mTLS: not started in this stack."""
    assert "gateway" not in services  # compose leaves out a service whose profile is off
    assert "gateway" in _config(COMPOSE_FILE)["services"]  # the base stack has it


def test_api_keys_come_from_a_docker_secret(services: dict) -> None:
    tokenizer = services["tokenizer"]
    (secret,) = tokenizer["secrets"]
    assert secret["source"] == "api_keys"
    assert tokenizer["environment"]["PAGEDSERVE_API_KEY_FILE"] == "/run/secrets/api_keys"


@pytest.mark.parametrize("name", ["engine", "tokenizer"])
def test_the_environment_names_real_flags(services: dict, name: str) -> None:
    parser = subparser(build_parser(), name)
    flags = {option for action in parser._actions for option in action.option_strings}
    for variable in services[name]["environment"]:
        if variable.startswith("PAGEDSERVE_TLS") or variable.startswith("PAGEDSERVE_ENGINE_TLS"):
            assert "--" + variable.removeprefix("PAGEDSERVE_").lower().replace("_", "-") in flags


def test_the_dev_ca_names_the_compose_services(tmp_path: Path) -> None:
    from cryptography import x509

    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "dev_ca.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    for service in ("engine", "tokenizer"):
        cert = x509.load_pem_x509_certificate((tmp_path / f"{service}.pem").read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert service in names.get_values_for_type(x509.DNSName)
        assert (tmp_path / f"{service}-key.pem").stat().st_mode & 0o077 == 0


def test_the_probe_speaks_mutual_tls(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials(
        [(Path(pki.key("server")).read_bytes(), pki.read("server"))],
        root_certificates=pki.read("ca"),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    try:

        def probe(**env: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, str(PROBE), f"127.0.0.1:{port}"],
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "HEALTHCHECK_TIMEOUT": "3", **env},
            )

        assert probe().returncode == 1  # plaintext to a TLS port
        assert probe(HEALTHCHECK_CA_FILE=pki.cert("ca")).returncode == 1  # no client cert
        good = probe(
            HEALTHCHECK_CA_FILE=pki.cert("ca"),
            HEALTHCHECK_CERT_FILE=pki.cert("client"),
            HEALTHCHECK_KEY_FILE=pki.key("client"),
        )
        assert good.returncode == 0 and "SERVING" in good.stdout
    finally:
        server.stop(None)
