"""TLS and mutual TLS on both hops, with certificates made by scripts/dev_ca.py: handshakes,
plaintext refused, client certificates required and verified, the engine link over mTLS,
the engine's refusal to listen in plaintext off loopback, and SIGHUP certificate reload."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients import NO_RETRY, Client, UnavailableError
from pagedserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.common.errors import ConfigError
from services.engine_service.server import EngineServer, EngineServerConfig
from services.security.tls import EngineLinkTLS, ServerTLSConfig
from services.tokenizer_service.config import TokenizerServerConfig
from services.tokenizer_service.server import TokenizerServer
from tests.services.helpers import wait_for
from tests.services.processes import free_port
from tests.services.secure import (
    ROOT,
    dev_ca,
    make_pki,
    start_engine_server,
    start_tokenizer_server,
    stop,
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def mtls(stack, pki):
    """Both hops over mutual TLS: client ─mTLS─▶ tokenizer ─mTLS─▶ engine."""
    server_tls = ServerTLSConfig(pki.cert("server"), pki.key("server"), pki.cert("ca"))
    engine = start_engine_server(stack, tls=server_tls)
    tokenizer = start_tokenizer_server(
        stack,
        engine.port,
        tls=server_tls,
        # The address says 127.0.0.1; check the certificate's DNS name instead.
        engine_tls=EngineLinkTLS(
            pki.cert("ca"), pki.cert("client"), pki.key("client"), server_name="localhost"
        ),
    )
    yield engine, tokenizer
    stop(stack, tokenizer, engine)


def _client(pki, port: int, client: str | None = "client", ca: str = "ca") -> Client:
    certs = {}
    if client is not None:
        certs = {"private_key": pki.key(client), "certificate_chain": pki.cert(client)}
    return Client(
        f"localhost:{port}", root_certificates=pki.cert(ca), retry=NO_RETRY, timeout=20, **certs
    )


def test_both_hops_over_mutual_tls(mtls, pki, stack):
    _, tokenizer = mtls
    with _client(pki, tokenizer.port) as client:
        result = client.generate_text(token_ids=[5, 6, 7], max_tokens=4, temperature=0)
        assert len(result.outputs[0].token_ids) == 4
        assert client.model_info().vocab_size == 49152
    stack.wait_until_idle()


@pytest.mark.parametrize("client_cert", [None, "expired", "stranger"])
def test_mtls_refuses_missing_expired_and_foreign_client_certificates(mtls, pki, client_cert):
    _, tokenizer = mtls
    with _client(pki, tokenizer.port, client_cert) as client, pytest.raises(UnavailableError):
        client.tokenize("hello")


def test_plaintext_to_a_tls_port_fails(mtls):
    engine, tokenizer = mtls
    plaintext = Client(f"127.0.0.1:{tokenizer.port}", retry=NO_RETRY, timeout=5)
    with plaintext as client, pytest.raises(UnavailableError):
        client.tokenize("hello")
    with grpc.insecure_channel(f"127.0.0.1:{engine.port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            engine_pb2_grpc.EngineServiceStub(channel).GetModelInfo(
                common_pb2.GetModelInfoRequest(), timeout=5
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_server_tls_verified_against_the_right_ca(stack, pki):
    tokenizer = start_tokenizer_server(
        stack,
        stack.engine_port,
        tls=ServerTLSConfig(pki.cert("server"), pki.key("server")),
    )
    try:
        with _client(pki, tokenizer.port, client=None) as client:
            assert client.tokenize("hello").count > 0
        wrong_ca = _client(pki, tokenizer.port, client=None, ca="other-ca")
        with wrong_ca as client, pytest.raises(UnavailableError):
            client.tokenize("hello")
    finally:
        stop(stack, tokenizer)


def test_dns_replicas_are_verified_against_the_name_not_their_address(stack, tmp_path):
    """`dns:///engine:50052` over TLS (compose's secure stack): each replica is dialled by IP,
    while its certificate names the service only, so the name is what must be checked."""
    ca_module = dev_ca()
    ca = ca_module.make_ca()
    ca.write(tmp_path, "ca")
    cert, key = ca_module.issue(ca, "localhost", []).write(tmp_path, "named")  # no IP in it
    engine = start_engine_server(stack, tls=ServerTLSConfig(str(cert), str(key)))

    async def start_tokenizer() -> TokenizerServer:
        server = TokenizerServer(
            TokenizerServerConfig(
                address="127.0.0.1:0",
                engine_address=f"dns:///localhost:{engine.port}",
                engine_poll_interval_s=0.2,
                engine_tls=EngineLinkTLS(str(tmp_path / "ca.pem")),
            ),
            stack.files,
        )
        await server.start()
        return server

    tokenizer = stack.loop.run(start_tokenizer())
    try:
        assert stack.loop.run(tokenizer.backend.wait_until_available(60.0))
        up = [a for a, r in tokenizer.backend.replicas.items() if r.available]
        assert up == [f"127.0.0.1:{engine.port}"], tokenizer.backend.describe()
        with Client(f"127.0.0.1:{tokenizer.port}", timeout=30) as client:
            result = client.generate_text(token_ids=[5, 6], max_tokens=2)
            assert len(result.outputs[0].token_ids) == 2
    finally:
        stop(stack, tokenizer, engine)


def test_engine_link_without_a_client_certificate_is_refused(mtls, pki, stack):
    engine, _ = mtls
    tokenizer = start_tokenizer_server(
        stack,
        engine.port,
        wait=False,
        engine_tls=EngineLinkTLS(pki.cert("ca"), server_name="localhost"),
    )
    try:
        assert not stack.loop.run(tokenizer.backend.wait_until_available(1.5))
        plaintext = Client(f"127.0.0.1:{tokenizer.port}", retry=NO_RETRY, timeout=10)
        with plaintext as client, pytest.raises(UnavailableError):
            client.generate_text(token_ids=[5, 6], max_tokens=2)
    finally:
        stop(stack, tokenizer)


def test_reload_rotates_the_engine_link_client_certificate(mtls, pki, stack, tmp_path):
    """The tokenizer's client certificate for the engine link is re-read on reload
    (SIGHUP): new calls present the new one (a certificate the engine does not trust makes
    it unreachable; a good one brings it back), and a stream opened before runs to its end."""
    engine, _ = mtls
    cert, key = tmp_path / "link.pem", tmp_path / "link-key.pem"
    shutil.copy(pki.cert("client"), cert)
    shutil.copy(pki.key("client"), key)
    tokenizer = start_tokenizer_server(
        stack,
        engine.port,
        engine_tls=EngineLinkTLS(pki.cert("ca"), str(cert), str(key), server_name="localhost"),
    )

    async def reload() -> None:
        tokenizer.reload()

    plaintext = Client(f"127.0.0.1:{tokenizer.port}", retry=NO_RETRY, timeout=60)
    try:
        with plaintext as client:
            with client.generate(token_ids=[5, 6, 7], max_tokens=600, ignore_eos=True) as stream:
                deltas = iter(stream)
                num_tokens = len(next(deltas).token_ids)
                shutil.copy(pki.cert("stranger"), cert)  # not signed by the engine's CA
                shutil.copy(pki.key("stranger"), key)
                stack.loop.run(reload())
                wait_for(lambda: not tokenizer.backend.available)
                with pytest.raises(UnavailableError):
                    client.generate_text(token_ids=[5, 6], max_tokens=2)
                num_tokens += sum(len(d.token_ids) for d in deltas)  # the old channel's
            assert num_tokens == 600

            shutil.copy(pki.cert("client"), cert)
            shutil.copy(pki.key("client"), key)
            stack.loop.run(reload())
            wait_for(lambda: tokenizer.backend.available)
            result = client.generate_text(token_ids=[5, 6], max_tokens=2)
            assert len(result.outputs[0].token_ids) == 2
    finally:
        stop(stack, tokenizer)


def _engine_server(stack, **config) -> EngineServer:
    """Built in the servers' loop (grpc.aio servers belong to one), not started."""

    async def build() -> EngineServer:
        return EngineServer(EngineServerConfig(**config))

    return stack.loop.run(build())


def test_engine_refuses_plaintext_off_loopback(stack, caplog):
    with pytest.raises(ConfigError, match="--allow-insecure-engine"):
        _engine_server(stack, address="0.0.0.0:0")
    with caplog.at_level(logging.WARNING, logger="services.engine"):
        _engine_server(stack, address="0.0.0.0:0", allow_insecure=True)
    lines = [r.getMessage() for r in caplog.records if r.name == "services.engine"]
    assert lines == [
        "engine API listening without TLS on a non-loopback address (--allow-insecure-engine)"
    ]
    _engine_server(stack, address="127.0.0.1:0")  # loopback: plaintext is fine
    _engine_server(stack, address="[::1]:0")


def test_bad_tls_flags_are_config_errors(stack, pki, tmp_path):
    with pytest.raises(ConfigError, match="go together"):
        ServerTLSConfig.from_flags(pki.cert("server"), None, None)
    not_pem = tmp_path / "x.pem"
    not_pem.write_text("hello")
    with pytest.raises(ConfigError, match="not a PEM file"):
        _engine_server(stack, tls=ServerTLSConfig(str(not_pem), pki.key("server")))


# ---- SIGHUP reload, in a real engine process ------------------------------------------------


def _serving(address: str, credentials: grpc.ChannelCredentials) -> bool:
    with grpc.secure_channel(address, credentials) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_sighup_reloads_the_certificate_without_dropping_streams(tiny_model_dir, pki, tmp_path):
    cert, key = tmp_path / "engine.pem", tmp_path / "engine-key.pem"
    shutil.copy(pki.cert("server"), cert)
    shutil.copy(pki.key("server"), key)
    port = free_port()
    address = f"localhost:{port}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "proto")]))
    env["PAGEDSERVE_TLS_CERT_FILE"], env["PAGEDSERVE_TLS_KEY_FILE"] = str(cert), str(key)
    argv = [sys.executable, "-m", "services", "engine", "--model", str(tiny_model_dir)]
    argv += ["--engine-addr", f"127.0.0.1:{port}", "--kv-cache-memory-bytes", str(64 << 20)]
    proc = subprocess.Popen(argv, env=env, cwd=ROOT)
    old_ca, new_ca = pki.channel_credentials("ca"), pki.channel_credentials("other-ca")
    try:
        wait_for(lambda: proc.poll() is not None or _serving(address, old_ca), timeout=120)
        assert proc.poll() is None
        with grpc.secure_channel(address, old_ca) as channel:
            stream = engine_pb2_grpc.EngineServiceStub(channel).Generate(
                engine_pb2.EngineGenerateRequest(
                    request_id="long",
                    prompt_token_ids=[5, 6, 7],
                    sampling_params=common_pb2.SamplingParams(max_tokens=1200, ignore_eos=True),
                ),
                timeout=120,
            )
            num_tokens = len(next(stream).token_ids)
            # Rotate to a certificate from another CA, written in place, then SIGHUP.
            shutil.copy(pki.cert("stranger"), cert)
            shutil.copy(pki.key("stranger"), key)
            proc.send_signal(signal.SIGHUP)
            wait_for(lambda: _serving(address, new_ca))
            assert not _serving(address, old_ca)  # new handshakes get the new certificate
            # ...while the stream opened before the reload runs to its end.
            messages = list(stream)
            num_tokens += sum(len(m.token_ids) for m in messages)
            assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert num_tokens == 1200
        time.sleep(0.1)
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_serve_runs_both_hops_over_mtls_from_one_set_of_flags(tiny_model_dir, pki, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("demo-key-0123456789abcdef demo\n")
    port, engine_port = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "proto")]))
    env["PAGEDSERVE_API_KEY"] = "demo-key-0123456789abcdef"
    argv = [sys.executable, "-m", "services", "serve", "--demo", "--prompt", "Hi", "--max-tokens"]
    argv += ["4", "--model", str(tiny_model_dir), "--kv-cache-memory-bytes", str(64 << 20)]
    argv += ["--port", str(port), "--host", "127.0.0.1"]
    argv += ["--engine-addr", f"127.0.0.1:{engine_port}", "--api-key-file", str(keys)]
    argv += ["--tls-cert-file", pki.cert("server"), "--tls-key-file", pki.key("server")]
    argv += ["--tls-client-ca-file", pki.cert("ca")]
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "through the public API" in done.stderr and "[4 tokens" in done.stderr
