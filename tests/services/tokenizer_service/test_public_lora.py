"""LoRA through the public API, on real loopback services (an engine service with LoRA
enabled behind a tokenizer service): the admin RPCs forwarded to the engine replicas,
`lora_name` on Generate and Encode giving the engine API's tokens and embeddings with the
same adapter, unknown names NOT_FOUND (passed through, no failover), errors naming the
replica, and the admin RPCs refused to a non-admin key."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from clients import AsyncClient, Client, LoraAdapter, NotFoundError
from engine import AsyncLLMEngine, EngineArgs
from pagedserve.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
)
from services.engine_service.server import EngineServer, EngineServerConfig
from services.tokenizer_service.server import TokenizerServer, TokenizerServerConfig
from tests.lora_utils import make_peft_adapter
from tests.model_utils import make_tiny_llama
from tests.services.conftest import ServiceStack
from tests.services.helpers import gather, request
from tests.services.secure import start_tokenizer_server, stop

PROMPT = [5, 17, 9, 33, 4]
GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
ADMIN = "ops-key-0123456789abcdef00"
TENANT = "bob-key-0123456789abcdef00"
LORA_ENGINE_ARGS = dict(enable_lora=True, max_lora_rank=8, kv_cache_memory_bytes=1 << 22)


@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("public-lora")
    base_dir = make_tiny_llama(root / "base", with_tokenizer=True, max_position_embeddings=128)
    adapter = root / "adapter"
    make_peft_adapter(base_dir, adapter, rank=4, alpha=8, targets=["q_proj", "down_proj"], seed=3)
    stack = ServiceStack(
        base_dir,
        engine_args=LORA_ENGINE_ARGS,
    )
    yield stack, adapter
    stack.close()


def code_and_details(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def public_tokens(stack: ServiceStack, lora_name: str = "") -> list[int]:
    msg = request(token_ids=PROMPT, **GREEDY)
    msg.lora_name = lora_name
    return gather(stack.public.Generate(msg, timeout=60))[0].token_ids


def engine_tokens(stack: ServiceStack, request_id: str, lora_name: str = "") -> list[int]:
    msg = engine_pb2.EngineGenerateRequest(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        sampling_params=common_pb2.SamplingParams(**GREEDY),
        lora_name=lora_name,
    )
    return [t for r in stack.engine_stub.Generate(msg, timeout=60) for t in r.token_ids]


def listed(stack: ServiceStack) -> list[tuple[str, int, str]]:
    reply = stack.public.ListLoraAdapters(common_pb2.ListLoraAdaptersRequest(), timeout=30)
    return [(a.lora_name, a.lora_int_id, a.lora_path) for a in reply.adapters]


def test_lora_through_the_public_api(lora_stack, tmp_path) -> None:
    stack, adapter = lora_stack
    replica = f"127.0.0.1:{stack.engine_port}"
    assert listed(stack) == []
    code, details = code_and_details(lambda: public_tokens(stack, "sql"))
    assert code == grpc.StatusCode.NOT_FOUND and "lora_name 'sql'" in details
    assert stack.tokenizer_server.backend.available  # a NOT_FOUND never marks a replica down

    code, details = code_and_details(
        lambda: stack.public.LoadLoraAdapter(
            common_pb2.LoadLoraAdapterRequest(lora_name="bad", lora_path=str(tmp_path)),
            timeout=30,
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert replica in details and "adapter_config.json is missing" in details
    reply = stack.public.LoadLoraAdapter(
        common_pb2.LoadLoraAdapterRequest(lora_name="sql", lora_path=str(adapter)), timeout=60
    )
    assert listed(stack) == [("sql", reply.lora_int_id, str(adapter))]
    code, details = code_and_details(
        lambda: stack.public.LoadLoraAdapter(
            common_pb2.LoadLoraAdapterRequest(lora_name="sql", lora_path=str(adapter)),
            timeout=30,
        )
    )
    assert code == grpc.StatusCode.ALREADY_EXISTS and replica in details

    # The public API's tokens are the engine API's with the same adapter, not the base's.
    with_adapter = public_tokens(stack, "sql")
    assert with_adapter == engine_tokens(stack, "engine-sql", "sql")
    assert public_tokens(stack) == engine_tokens(stack, "engine-base") != with_adapter
    beam = generation_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=PROMPT),
        sampling_params=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
        beam_width=1,
        lora_name="sql",
    )
    assert list(gather(stack.public.Generate(beam, timeout=60))[0].token_ids) == with_adapter[:4]

    def embedding(lora_name: str) -> list[float]:
        reply = stack.public.Encode(
            generation_pb2.EncodeRequest(
                token_ids=[common_pb2.TokenIds(ids=PROMPT)], lora_name=lora_name
            ),
            timeout=60,
        )
        return list(reply.embeddings[0].values)

    engine_embedding = stack.engine_stub.Encode(
        engine_pb2.EngineEncodeRequest(request_id="e", prompt_token_ids=PROMPT, lora_name="sql"),
        timeout=60,
    ).embedding
    assert embedding("sql") == pytest.approx(list(engine_embedding), abs=1e-6)
    assert embedding("sql") != embedding("")

    stack.public.UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(lora_name="sql"), timeout=30)
    assert listed(stack) == []
    code, _ = code_and_details(lambda: public_tokens(stack, "sql"))
    assert code == grpc.StatusCode.NOT_FOUND
    code, details = code_and_details(
        lambda: stack.public.UnloadLoraAdapter(
            common_pb2.UnloadLoraAdapterRequest(lora_name="sql"), timeout=30
        )
    )
    assert code == grpc.StatusCode.NOT_FOUND and replica in details
    stack.wait_until_idle()  # no KV block left behind by the refused requests


def test_lora_admin_rpcs_need_an_admin_key(lora_stack, tmp_path) -> None:
    stack, adapter = lora_stack
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"{ADMIN}  ops  admin\n{TENANT}  bob\n")
    server = start_tokenizer_server(stack, stack.engine_port, api_key_file=str(key_file))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        public = generation_pb2_grpc.TextGenerationServiceStub(channel)
        calls = {
            "LoadLoraAdapter": lambda md: public.LoadLoraAdapter(
                common_pb2.LoadLoraAdapterRequest(lora_name="k", lora_path=str(adapter)),
                metadata=md,
                timeout=60,
            ),
            "ListLoraAdapters": lambda md: public.ListLoraAdapters(
                common_pb2.ListLoraAdaptersRequest(), metadata=md, timeout=30
            ),
            "UnloadLoraAdapter": lambda md: public.UnloadLoraAdapter(
                common_pb2.UnloadLoraAdapterRequest(lora_name="k"), metadata=md, timeout=30
            ),
        }
        tenant = [("authorization", f"Bearer {TENANT}")]
        admin = [("authorization", f"Bearer {ADMIN}")]
        for name, call in calls.items():
            code, details = code_and_details(lambda call=call: call(tenant))
            assert code == grpc.StatusCode.PERMISSION_DENIED and name in details
        calls["LoadLoraAdapter"](admin)
        assert [a.lora_name for a in calls["ListLoraAdapters"](admin).adapters] == ["k"]
        # A tenant may use the adapter the operator loaded.
        msg = request(token_ids=PROMPT, **GREEDY)
        msg.lora_name = "k"
        tokens = gather(public.Generate(msg, metadata=tenant, timeout=60))[0].token_ids
        assert tokens == engine_tokens(stack, "engine-k", "k")
        calls["UnloadLoraAdapter"](admin)
        assert not calls["ListLoraAdapters"](admin).adapters
    finally:
        channel.close()
        stop(stack, server)


def test_lora_admin_rpcs_reach_every_replica(lora_stack) -> None:
    """Two engine replicas behind one tokenizer service: a load refused by one is undone on
    the other and names the refusing replica; List shows what every replica has."""
    stack, adapter = lora_stack
    engine_b = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=str(stack.model_dir), skip_tokenizer_init=True, **LORA_ENGINE_ARGS)
    )

    async def start_b() -> EngineServer:
        server = EngineServer(EngineServerConfig(address="127.0.0.1:0", log_stats_interval_s=0))
        await server.start()
        await server.attach_engine(engine_b)
        return server

    server_b = stack.loop.run(start_b())
    replica_a, replica_b = f"127.0.0.1:{stack.engine_port}", f"127.0.0.1:{server_b.port}"

    async def start_front() -> TokenizerServer:
        config = TokenizerServerConfig(
            address="127.0.0.1:0",
            engine_address=f"{replica_a},{replica_b}",
            engine_poll_interval_s=0.2,
        )
        server = TokenizerServer(config, stack.files)
        await server.start()
        assert await server.backend.wait_until_available(30.0)
        return server

    front = stack.loop.run(start_front())
    channels = [grpc.insecure_channel(a) for a in (f"127.0.0.1:{front.port}", replica_b)]
    try:
        public = generation_pb2_grpc.TextGenerationServiceStub(channels[0])
        engine_b_stub = engine_pb2_grpc.EngineServiceStub(channels[1])

        def names(stub) -> list[str]:
            reply = stub.ListLoraAdapters(common_pb2.ListLoraAdaptersRequest(), timeout=30)
            return [a.lora_name for a in reply.adapters]

        def load(stub, name: str) -> None:
            request = common_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=str(adapter))
            stub.LoadLoraAdapter(request, timeout=60)

        load(engine_b_stub, "dup")  # B alone has it
        code, details = code_and_details(lambda: load(public, "dup"))
        assert code == grpc.StatusCode.ALREADY_EXISTS and replica_b in details
        assert names(stack.engine_stub) == [] and names(engine_b_stub) == ["dup"]  # undone on A
        assert names(public) == []  # not on every replica

        load(public, "sql")
        assert names(stack.engine_stub) == ["sql"] and names(engine_b_stub) == ["dup", "sql"]
        assert names(public) == ["sql"]
        engine_b_stub.UnloadLoraAdapter(
            common_pb2.UnloadLoraAdapterRequest(lora_name="sql"), timeout=30
        )
        assert names(public) == []
        code, details = code_and_details(
            lambda: public.UnloadLoraAdapter(
                common_pb2.UnloadLoraAdapterRequest(lora_name="sql"), timeout=30
            )
        )
        assert code == grpc.StatusCode.NOT_FOUND and replica_b in details
        assert names(stack.engine_stub) == []  # A unloaded it all the same
    finally:
        for channel in channels:
            channel.close()
        stop(stack, front, server_b)
        engine_b.shutdown()


def test_lora_through_the_python_clients(lora_stack) -> None:
    """`Client` / `AsyncClient`: load, list and unload adapters, `lora_name=` on generate
    and encode (the public API's answers), and an unknown name as NotFoundError."""
    stack, adapter = lora_stack
    address = f"127.0.0.1:{stack.public_port}"
    with Client(address, timeout=60) as client:
        lora_id = client.load_lora_adapter("py", str(adapter))
        assert client.list_lora_adapters() == [LoraAdapter("py", lora_id, str(adapter))]
        result = client.generate_text(token_ids=PROMPT, lora_name="py", **GREEDY)
        assert result.outputs[0].token_ids == public_tokens(stack, "py")
        assert result.outputs[0].token_ids != public_tokens(stack)
        assert client.encode(token_ids=[PROMPT], lora_name="py") != client.encode(
            token_ids=[PROMPT]
        )
        with pytest.raises(NotFoundError, match="lora_name 'nope'"):
            client.generate_text(token_ids=PROMPT, lora_name="nope", **GREEDY)

        async def async_calls() -> tuple[list[int], list[str]]:
            async with AsyncClient(address, timeout=60) as aclient:
                out = await aclient.generate_text(token_ids=PROMPT, lora_name="py", **GREEDY)
                await aclient.unload_lora_adapter("py")
                names = [a.lora_name for a in await aclient.list_lora_adapters()]
                return out.outputs[0].token_ids, names

        tokens, names = asyncio.run(async_calls())
        assert tokens == result.outputs[0].token_ids and names == []


def test_lora_from_the_command_line(lora_stack, capsys) -> None:
    """`pagedserve lora load|list|unload` and `generate --lora-name` against the real
    services: the CLI's answer with the adapter is the public API's with it."""
    from clients.cli import main

    stack, adapter = lora_stack
    address = ["--address", f"127.0.0.1:{stack.public_port}"]
    assert main(["lora", "load", "cli-sql", str(adapter), *address]) == 0
    assert "loaded cli-sql (lora_int_id " in capsys.readouterr().out
    assert main(["lora", "list", *address]) == 0
    assert capsys.readouterr().out.split("\t")[::2] == ["cli-sql", f"{adapter}\n"]

    flags = ["--temperature", "0", "--max-tokens", "6", "--ignore-eos", *address]
    assert main(["generate", "Hello there", "--lora-name", "cli-sql", *flags]) == 0
    with_adapter = capsys.readouterr().out.rstrip("\n")
    expected = gather(
        stack.public.Generate(
            generation_pb2.GenerateRequest(
                text="Hello there",
                sampling_params=common_pb2.SamplingParams(**GREEDY),
                lora_name="cli-sql",
            ),
            timeout=60,
        )
    )[0].text
    assert with_adapter == expected
    assert main(["generate", "Hello there", *flags]) == 0
    assert capsys.readouterr().out.rstrip("\n") != with_adapter  # the base model's

    assert main(["lora", "unload", "cli-sql", *address]) == 0
    assert capsys.readouterr().out == "unloaded cli-sql\n"
    assert main(["lora", "unload", "cli-sql", *address]) == 1  # NOT_FOUND, printed
    assert "cli-sql" in capsys.readouterr().err
    assert listed(stack) == []


def test_a_replica_that_joins_later_gets_the_adapters_before_any_request(lora_stack) -> None:
    """Load while replica B is down: A alone loads it and the call succeeds; when B comes
    up, the tokenizer service loads the adapter onto it before routing anything there."""
    from tests.services.helpers import wait_for
    from tests.services.processes import free_port

    stack, adapter = lora_stack
    replica_a, port_b = f"127.0.0.1:{stack.engine_port}", free_port()
    replica_b = f"127.0.0.1:{port_b}"

    async def start_front() -> TokenizerServer:
        config = TokenizerServerConfig(
            address="127.0.0.1:0",
            engine_address=f"{replica_a},{replica_b}",
            engine_poll_interval_s=0.2,
        )
        server = TokenizerServer(config, stack.files)
        await server.start()
        assert await server.backend.wait_until_available(30.0)
        return server

    front = stack.loop.run(start_front())
    channels = [grpc.insecure_channel(a) for a in (f"127.0.0.1:{front.port}", replica_b)]
    engine_b, server_b = None, None
    public = generation_pb2_grpc.TextGenerationServiceStub(channels[0])
    engine_b_stub = engine_pb2_grpc.EngineServiceStub(channels[1])

    def names(stub) -> list[str]:
        reply = stub.ListLoraAdapters(common_pb2.ListLoraAdaptersRequest(), timeout=30)
        return [a.lora_name for a in reply.adapters]

    try:
        request = common_pb2.LoadLoraAdapterRequest(lora_name="late", lora_path=str(adapter))
        public.LoadLoraAdapter(request, timeout=60)  # B is down: A alone loads it
        assert names(public) == names(stack.engine_stub) == ["late"]

        engine_b = AsyncLLMEngine.from_engine_args(
            EngineArgs(model=str(stack.model_dir), skip_tokenizer_init=True, **LORA_ENGINE_ARGS)
        )

        async def start_b() -> EngineServer:
            config = EngineServerConfig(address=replica_b, log_stats_interval_s=0)
            server = EngineServer(config)
            await server.start()
            await server.attach_engine(engine_b)
            return server

        server_b = stack.loop.run(start_b())
        wait_for(lambda: front.backend.replicas[replica_b].available, timeout=60)
        assert names(engine_b_stub) == ["late"]  # loaded before B was routable
        assert engine_tokens(stack, "a-late", "late") == _tokens(engine_b_stub, "late")
        assert names(public) == ["late"]
        public.UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(lora_name="late"), timeout=30)
        assert names(engine_b_stub) == names(stack.engine_stub) == []
    finally:
        for channel in channels:
            channel.close()
        stop(stack, front, *([server_b] if server_b is not None else []))
        if engine_b is not None:
            engine_b.shutdown()


def _tokens(stub, lora_name: str) -> list[int]:
    msg = engine_pb2.EngineGenerateRequest(
        request_id="b-" + lora_name,
        prompt_token_ids=PROMPT,
        sampling_params=common_pb2.SamplingParams(**GREEDY),
        lora_name=lora_name,
    )
    return [t for r in stub.Generate(msg, timeout=60) for t in r.token_ids]
