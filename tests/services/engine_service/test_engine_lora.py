"""LoRA over the engine API, on a real loopback engine service started with LoRA enabled:
LoadLoraAdapter / ListLoraAdapters / UnloadLoraAdapter, `lora_name` on Generate and Encode
(unknown -> NOT_FOUND), tokens equal to the offline engine's with the same adapter, and
the status codes of a bad adapter, a duplicate name and an engine without LoRA."""

from __future__ import annotations

import grpc
import pytest

from engine import LLM, AsyncLLMEngine, EngineArgs, LoRARequest, SamplingParams
from pagedserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.engine_service.server import EngineServer, EngineServerConfig
from tests.lora_utils import make_peft_adapter
from tests.model_utils import make_tiny_llama
from tests.services.conftest import LoopThread

PROMPT = [5, 17, 9, 33, 4]
ENGINE_KWARGS = dict(max_model_len=128, kv_cache_memory_bytes=1 << 22, enable_lora=True)


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-lora")
    base_dir = make_tiny_llama(root / "base", max_position_embeddings=128)
    adapter = root / "adapter"
    make_peft_adapter(base_dir, adapter, rank=4, alpha=8, targets=["q_proj", "down_proj"], seed=3)
    loop = LoopThread()
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=str(base_dir), skip_tokenizer_init=True, max_lora_rank=8, **ENGINE_KWARGS)
    )

    async def start() -> EngineServer:
        server = EngineServer(EngineServerConfig(address="127.0.0.1:0", log_stats_interval_s=0))
        await server.start()
        await server.attach_engine(engine)
        return server

    server = loop.run(start())
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield engine_pb2_grpc.EngineServiceStub(channel), base_dir, adapter
    channel.close()
    loop.run(server.stop(0))
    engine.shutdown()
    loop.close()


def generate(stub, request_id: str, lora_name: str = "") -> list[int]:
    request = engine_pb2.EngineGenerateRequest(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        lora_name=lora_name,
    )
    return [t for r in stub.Generate(request, timeout=60) for t in r.token_ids]


def code_and_details(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_lora_adapters_over_grpc(lora_engine, tmp_path) -> None:
    stub, base_dir, adapter = lora_engine
    code, details = code_and_details(lambda: generate(stub, "unknown", "sql"))
    assert code == grpc.StatusCode.NOT_FOUND and "lora_name 'sql'" in details
    code, details = code_and_details(
        lambda: stub.LoadLoraAdapter(
            common_pb2.LoadLoraAdapterRequest(lora_name="bad", lora_path=str(tmp_path)),
            timeout=30,
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "adapter_config.json is missing" in details
    reply = stub.LoadLoraAdapter(
        common_pb2.LoadLoraAdapterRequest(lora_name="sql", lora_path=str(adapter)), timeout=60
    )
    assert reply.lora_int_id >= 1
    code, _ = code_and_details(
        lambda: stub.LoadLoraAdapter(
            common_pb2.LoadLoraAdapterRequest(lora_name="sql", lora_path=str(adapter)),
            timeout=30,
        )
    )
    assert code == grpc.StatusCode.ALREADY_EXISTS
    listed = stub.ListLoraAdapters(common_pb2.ListLoraAdaptersRequest(), timeout=30).adapters
    assert [(a.lora_name, a.lora_int_id, a.lora_path) for a in listed] == [
        ("sql", reply.lora_int_id, str(adapter))
    ]

    offline = LLM(model=str(base_dir), max_lora_rank=8, **ENGINE_KWARGS)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    lora = LoRARequest("sql", 1, str(adapter))
    expected = offline.generate(
        {"prompt_token_ids": PROMPT}, params, use_tqdm=False, lora_request=lora
    )
    base = offline.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    with_adapter = generate(stub, "with-sql", "sql")
    assert with_adapter == list(expected[0].outputs[0].token_ids)
    assert generate(stub, "base") == list(base[0].outputs[0].token_ids) != with_adapter
    embedding = stub.Encode(
        engine_pb2.EngineEncodeRequest(request_id="enc", prompt_token_ids=PROMPT, lora_name="sql"),
        timeout=60,
    ).embedding
    base_embedding = stub.Encode(
        engine_pb2.EngineEncodeRequest(request_id="enc-base", prompt_token_ids=PROMPT), timeout=60
    ).embedding
    assert len(embedding) == len(base_embedding) and list(embedding) != list(base_embedding)

    stub.UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(lora_name="sql"), timeout=30)
    assert not stub.ListLoraAdapters(common_pb2.ListLoraAdaptersRequest(), timeout=30).adapters
    code, _ = code_and_details(lambda: generate(stub, "after-unload", "sql"))
    assert code == grpc.StatusCode.NOT_FOUND


def test_lora_rpcs_need_an_engine_with_lora(stack) -> None:
    code, details = code_and_details(
        lambda: stack.engine_stub.LoadLoraAdapter(
            common_pb2.LoadLoraAdapterRequest(lora_name="x", lora_path="/nowhere"), timeout=30
        )
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "--enable-lora" in details
