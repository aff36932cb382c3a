"""API keys and tenants on the public API: every RPC without, with a wrong and with a right
key; health and reflection open; admin-only RPCs; request ids scoped to the tenant;
per-tenant rate and stream limits with `retry-after-ms`; keys absent from logs, spans and
metrics."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest

from clients import AsyncClient, Client
from clients.cli import main as client_main
from pagedserve.v1 import common_pb2, engine_pb2, generation_pb2, generation_pb2_grpc
from services.common.errors import ConfigError
from services.security.auth import ApiKeys, fingerprint
from services.security.tenancy import UNAUTHENTICATED_MESSAGE
from tests.services.helpers import gather, request, token_prompts, wait_for
from tests.services.secure import start_tokenizer_server, stop

ALICE = "alice-key-0123456789abcdef"
ALICE_2 = "alice-second-key-0123456789"
BOB = "bob-key-0123456789abcdef00"
OPS = "ops-key-0123456789abcdef00"
SLOW = "slow-key-0123456789abcdef0"
LONELY = "lonely-key-0123456789abcdef"
ALL_KEYS = (ALICE, ALICE_2, BOB, OPS, SLOW, LONELY)
KEY_FILE = f"""\
# key                        tenant  options
{ALICE}  alice   max_streams=2 weight=2.5
{ALICE_2}  alice                 # a second key for the same tenant (rotation)
{BOB}  bob
{OPS}  ops     admin
{SLOW}  slow    rps=2
{LONELY}
"""

_EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    return _EXPORTER


@pytest.fixture(scope="module")
def keyed(stack, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(KEY_FILE)
    server = start_tokenizer_server(stack, stack.engine_port, api_key_file=str(key_file))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield server, generation_pb2_grpc.TextGenerationServiceStub(channel), key_file
    channel.close()
    stop(stack, server)


def _auth(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


CALLS = {
    "Generate": lambda s, md: gather(
        s.Generate(request(token_ids=[5, 6], max_tokens=2), metadata=md, timeout=30)
    ),
    "Encode": lambda s, md: s.Encode(generation_pb2.EncodeRequest(texts=["hi"]), metadata=md),
    "Abort": lambda s, md: s.Abort(common_pb2.AbortRequest(request_ids=["x"]), metadata=md),
    "Tokenize": lambda s, md: s.Tokenize(generation_pb2.TokenizeRequest(text="hi"), metadata=md),
    "Detokenize": lambda s, md: s.Detokenize(
        generation_pb2.DetokenizeRequest(token_ids=[5]), metadata=md
    ),
    "GetModelInfo": lambda s, md: s.GetModelInfo(common_pb2.GetModelInfoRequest(), metadata=md),
    "Health": lambda s, md: s.Health(common_pb2.HealthRequest(), metadata=md),
    "LoadLoraAdapter": lambda s, md: s.LoadLoraAdapter(
        common_pb2.LoadLoraAdapterRequest(lora_name="a", lora_path="/nowhere"), metadata=md
    ),
    "UnloadLoraAdapter": lambda s, md: s.UnloadLoraAdapter(
        common_pb2.UnloadLoraAdapterRequest(lora_name="a"), metadata=md
    ),
    "ListLoraAdapters": lambda s, md: s.ListLoraAdapters(
        common_pb2.ListLoraAdaptersRequest(), metadata=md
    ),
}
# Admin-only, and what an admin key gets from the shared stack (its engine has no LoRA).
ADMIN_CALLS = {
    "Health": grpc.StatusCode.OK,
    "LoadLoraAdapter": grpc.StatusCode.FAILED_PRECONDITION,
    "UnloadLoraAdapter": grpc.StatusCode.FAILED_PRECONDITION,
    "ListLoraAdapters": grpc.StatusCode.OK,
}


def _code(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_the_public_rpcs_are_all_guarded():
    assert set(CALLS) == set(
        generation_pb2.DESCRIPTOR.services_by_name["TextGenerationService"].methods_by_name
    )


@pytest.mark.parametrize("method", sorted(CALLS))
def test_every_rpc_without_with_a_wrong_and_with_a_right_key(keyed, method):
    _, stub, _ = keyed
    call = CALLS[method]
    unauthenticated = (grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
    assert _code(lambda: call(stub, None)) == unauthenticated
    assert _code(lambda: call(stub, _auth("not-a-key-0123456789abcdef"))) == unauthenticated
    assert _code(lambda: call(stub, [("authorization", ALICE)])) == unauthenticated  # no Bearer
    code, details = _code(lambda: call(stub, _auth(ALICE)))
    if method in ADMIN_CALLS:  # admin only
        assert code == grpc.StatusCode.PERMISSION_DENIED and "admin" in details
        assert _code(lambda: call(stub, _auth(OPS)))[0] == ADMIN_CALLS[method]
    else:
        assert code == grpc.StatusCode.OK, details


def test_health_and_reflection_need_no_key(keyed):
    server, _, _ = keyed
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        listed = next(iter(stub.ServerReflectionInfo(iter([ask]), timeout=10)))
        names = {s.name for s in listed.list_services_response.service}
        assert "pagedserve.v1.TextGenerationService" in names


def _long(stub, key: str, request_id: str):
    req = request(token_ids=[7, 8, 9], request_id=request_id, max_tokens=2000, ignore_eos=True)
    stream = stub.Generate(req, metadata=_auth(key), timeout=60)
    return stream, next(stream)


def test_request_ids_are_scoped_to_the_tenant(keyed, stack):
    _, stub, _ = keyed
    alice, alice_first = _long(stub, ALICE, "same")
    bob, bob_first = _long(stub, BOB, "same")  # the same id in another tenant: no conflict
    assert alice_first.request_id == bob_first.request_id == "same"
    # Bob cannot see or touch Alice's request: his own "same" is aborted, hers runs on.
    reply = stub.Abort(common_pb2.AbortRequest(request_ids=["same"]), metadata=_auth(BOB))
    assert list(reply.aborted_request_ids) == ["same"]
    assert gather([bob_first, *bob])[0].finish_reason == common_pb2.FINISH_REASON_ABORT
    reply = stub.Abort(common_pb2.AbortRequest(request_ids=["same"]), metadata=_auth(LONELY))
    assert list(reply.aborted_request_ids) == []
    # Alice's second key is the same tenant: it reaches her request.
    alice_out = gather([alice_first, *_take(alice, 3)])[0]
    assert alice_out.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED  # still running
    reply = stub.Abort(common_pb2.AbortRequest(request_ids=["same"]), metadata=_auth(ALICE_2))
    assert list(reply.aborted_request_ids) == ["same"]
    rest = gather(alice)[0]
    assert rest.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert len(alice_out.token_ids) + len(rest.token_ids) > 1
    stack.wait_until_idle()


def _take(stream, n: int) -> list:
    return [next(stream) for _ in range(n)]


def _retry_after_ms(exc: grpc.RpcError) -> int:
    return int(dict(exc.trailing_metadata())["retry-after-ms"])


def test_tenant_rate_limit_with_retry_after(keyed):
    _, stub, _ = keyed
    tokenize = generation_pb2.TokenizeRequest(text="hi")
    codes, retry_after = [], None
    # rps=2: a burst of two, then refused once calls come faster than two a second (on a
    # loaded machine a few more may pass first, as the bucket refills between slow calls).
    while retry_after is None and len(codes) < 100:
        try:
            stub.Tokenize(tokenize, metadata=_auth(SLOW))
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append(exc.code().name)
            assert "rate limit of 2 requests per second" in exc.details()
            retry_after = _retry_after_ms(exc)
    assert codes[:2] == ["OK", "OK"] and codes[-1] == "RESOURCE_EXHAUSTED", codes
    assert retry_after is not None and 0 < retry_after <= 501
    time.sleep(retry_after / 1000 + 0.05)
    assert stub.Tokenize(tokenize, metadata=_auth(SLOW)).count > 0
    # Other tenants are not slowed down.
    for _ in range(5):
        stub.Tokenize(tokenize, metadata=_auth(BOB))


def test_tenant_stream_limit_with_retry_after(keyed, stack):
    server, stub, _ = keyed
    first, _ = _long(stub, ALICE, "s1")
    second, _ = _long(stub, ALICE_2, "s2")  # max_streams=2 counts the tenant, not the key
    with pytest.raises(grpc.RpcError) as info:
        gather(stub.Generate(request(token_ids=[5], max_tokens=2), metadata=_auth(ALICE)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_streams=2" in info.value.details() and _retry_after_ms(info.value) > 0
    assert stub.Tokenize(generation_pb2.TokenizeRequest(text="x"), metadata=_auth(ALICE)).count
    gather(stub.Generate(request(token_ids=[5], max_tokens=2), metadata=_auth(BOB)))
    first.cancel()
    wait_for(lambda: server.guard.limits.num_streams("alice") == 1)
    out = gather(stub.Generate(request(token_ids=[5], max_tokens=2), metadata=_auth(ALICE)))
    assert len(out[0].token_ids) == 2
    second.cancel()
    stack.wait_until_idle()
    assert server.guard.limits.num_streams("alice") == 0


def test_keys_never_reach_logs_spans_or_metrics(keyed, spans, caplog):
    server, stub, _ = keyed
    spans.clear()
    with caplog.at_level(logging.DEBUG):
        for key in (*ALL_KEYS, "wrong-key-0123456789abcdef"):
            for name in ("Tokenize", "Generate", "Health"):
                _code(lambda key=key, name=name: CALLS[name](stub, _auth(key)))
        gather(stub.Generate(request(token_ids=[5, 6], max_tokens=3, request_id="r1"),
                             metadata=_auth(ALICE)))  # fmt: skip
    wait_for(lambda: spans.get_finished_spans())
    logged = caplog.text + "".join(str(r.__dict__) for r in caplog.records)
    exported = "".join(s.to_json() for s in spans.get_finished_spans())
    metrics = generate_latest(server.servicer.rpc_metrics.registry).decode()
    for key in ALL_KEYS:
        for where, text in (("logs", logged), ("spans", exported), ("metrics", metrics)):
            assert key not in text, f"an API key in the {where}"
    # The tenant is there instead.
    tenants = {s.attributes.get("pagedserve.tenant") for s in spans.get_finished_spans()}
    assert {"alice", "bob", "ops", fingerprint(LONELY)} <= tenants  # (slow: rate-limited)
    assert 'pagedserve:tenant_requests_total{method="Generate",tenant="alice"}' in metrics
    assert 'tenant_rejected_requests_total{reason="unauthenticated",tenant=""}' in metrics
    assert 'tenant_rejected_requests_total{reason="permission_denied",tenant="bob"}' in metrics


def test_client_and_cli_send_the_key(keyed, monkeypatch, capsys):
    server, _, _ = keyed
    address = f"127.0.0.1:{server.port}"
    with Client(address, api_key=BOB, timeout=20) as client:
        assert client.tokenize("hello").count > 0
    monkeypatch.setenv("PAGEDSERVE_API_KEY", OPS)
    with Client(address, timeout=20) as client:
        assert client.health().healthy  # admin, from the environment
    assert client_main(["tokenize", "hello", "--address", address, "--api-key", BOB]) == 0
    monkeypatch.delenv("PAGEDSERVE_API_KEY")
    assert client_main(["tokenize", "hello", "--address", address]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err.upper()


def test_sighup_reloads_the_key_file(keyed, tmp_path):
    server, stub, key_file = keyed
    new_key = "rotated-key-0123456789abcdef"
    try:
        key_file.write_text(KEY_FILE.replace(BOB, new_key).replace("weight=2.5", "weight=4"))
        server.reload()
        alice = server.guard.keys.authenticate(ALICE)
        assert alice is not None and alice.tenant.weight == 4.0  # the engine gets it next
        tokenize = generation_pb2.TokenizeRequest(text="hi")
        assert stub.Tokenize(tokenize, metadata=_auth(new_key)).count > 0
        assert _code(lambda: stub.Tokenize(tokenize, metadata=_auth(BOB)))[0] == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        key_file.write_text("broken line with=unknown option\n")
        server.reload()  # refused: the loaded keys stay
        assert stub.Tokenize(tokenize, metadata=_auth(new_key)).count > 0
    finally:
        key_file.write_text(KEY_FILE)
        server.reload()


def test_key_file_format():
    keys = ApiKeys.parse(KEY_FILE)
    assert len(keys) == 6
    alice = keys.authenticate(ALICE_2)
    assert alice is not None and alice.tenant.name == "alice" and alice.tenant.max_streams == 2
    assert alice.tenant.weight == 2.5  # given on the first key, it holds for the second
    ops = keys.authenticate(OPS)
    assert ops is not None and ops.admin and ops.tenant.rps is None
    lonely = keys.authenticate(LONELY)
    assert lonely is not None and lonely.tenant.name == fingerprint(LONELY)
    assert (lonely.tenant.max_streams, lonely.tenant.rps, lonely.admin) == (None, None, False)
    assert lonely.tenant.weight == 1.0
    assert keys.authenticate(ALICE + "x") is None and keys.authenticate("") is None
    hashed = ApiKeys.parse("key#with#hash-0123456789 t1  # comment\n")
    assert hashed.authenticate("key#with#hash-0123456789") is not None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no API keys"),
        ("short t", "at least 16"),
        (f"{ALICE} a b", "unknown option 'b'"),
        (f"{ALICE} a rps=0", "rps must be a positive number"),
        (f"{ALICE} a max_streams=x", "max_streams='x' is not a number"),
        (f"{ALICE} a/b", "tenant name"),
        (f"{ALICE} a\n{ALICE} b", "appears twice"),
        (f"{ALICE} a rps=1\n{BOB} a rps=2", "two different limits"),
        (f"{ALICE} a weight=2\n{BOB} a weight=3", "two different limits or weights"),
        (f"{ALICE} a weight=0", "weight must be a positive number"),
        (f"{ALICE} a weight=-1", "weight must be a positive number"),
        (f"{ALICE} a weight=nan", "weight must be a positive number"),
        (f"{ALICE} a weight=heavy", "weight='heavy' is not a number"),
    ],
)
def test_key_file_errors_name_the_line_not_the_key(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        ApiKeys.parse(text, source="keys.txt")
    assert ALICE not in str(info.value) and BOB not in str(info.value)
    assert str(info.value).startswith("keys.txt")


def test_parallel_streams_of_many_tenants_do_not_leak_slots(keyed, stack):
    server, stub, _ = keyed
    errors: list[BaseException] = []

    def run(key: str) -> None:
        try:
            for _ in range(3):
                gather(stub.Generate(request(token_ids=[5], max_tokens=3), metadata=_auth(key)))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in (BOB, LONELY, OPS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert all(server.guard.limits.num_streams(t) == 0 for t in ("bob", "ops"))
    stack.wait_until_idle()


def _cached_tokens(stub, key: str, prompt: list[int]) -> int:
    out = gather(stub.Generate(request(token_ids=prompt, max_tokens=1), metadata=_auth(key)))
    assert out[0].usage is not None
    return out[0].usage.cached_tokens


def test_tenants_never_share_prefix_cache_blocks(keyed, stack):
    _, stub, _ = keyed
    prompt = token_prompts(1, seed=12345)[0] * 3  # at least two full blocks
    assert len(prompt) >= 32
    assert _cached_tokens(stub, BOB, prompt) == 0
    assert _cached_tokens(stub, BOB, prompt) >= 32  # bob's own blocks are reused...
    assert _cached_tokens(stub, LONELY, prompt) == 0  # ...but no other tenant sees them
    assert _cached_tokens(stub, ALICE, prompt) == 0
    assert _cached_tokens(stub, ALICE_2, prompt) >= 32  # the same tenant, another key
    stack.wait_until_idle()


def test_the_engine_keeps_cache_salts_apart(stack):
    prompt = token_prompts(1, seed=777)[0] * 3

    def cached(salt: str) -> int:
        msg = engine_pb2.EngineGenerateRequest(
            request_id=f"salted-{salt}-{time.monotonic_ns()}",
            prompt_token_ids=prompt,
            sampling_params=common_pb2.SamplingParams(max_tokens=1),
            cache_salt=salt,
        )
        return list(stack.engine_stub.Generate(msg, timeout=30))[-1].usage.cached_tokens

    assert cached("a") == 0 and cached("a") >= 32
    assert cached("b") == 0 and cached("") == 0 and cached("") >= 32


def test_async_client_sends_the_key(keyed):
    server, _, _ = keyed
    address = f"127.0.0.1:{server.port}"

    async def main() -> tuple[int, int]:
        async with AsyncClient(address, api_key=BOB, timeout=30) as client:
            count = (await client.tokenize("hello")).count
            result = await client.generate_text(token_ids=[5, 6], max_tokens=2)
            return count, len(result.outputs[0].token_ids)

    count, num_tokens = asyncio.run(main())
    assert count > 0 and num_tokens == 2
