"""Pooling over gRPC with an engine started with MEAN pooling on a Matryoshka model:
`pooling_params.dimensions` through the public Encode (tokenizer service) and the engine
Encode, bad values as INVALID_ARGUMENT naming the field, and vLLM's Embed (no dimensions
field in its protocol) pooled the engine's way. Real servers on loopback ports."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

from engine import LLM, PoolingParams
from pagedserve.v1 import common_pb2, engine_pb2, generation_pb2
from tests.model_utils import make_tiny_llama
from tests.services.conftest import ENGINE_KWARGS, ServiceStack

POOLER = {"pooling_type": "MEAN"}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 61))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_llama(
        tmp_path_factory.mktemp("pool-grpc") / "tiny",
        with_tokenizer=True,
        max_position_embeddings=256,
    )
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    return path


@pytest.fixture(scope="module")
def mean_stack(model_dir: Path) -> Iterator[ServiceStack]:
    stack = ServiceStack(model_dir, engine_args={"pooler_config": POOLER})
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), pooler_config=POOLER, **ENGINE_KWARGS)


def expected(offline: LLM, dimensions: int | None) -> list[torch.Tensor]:
    outputs = offline.encode(
        [{"prompt_token_ids": p} for p in PROMPTS],
        PoolingParams(dimensions=dimensions),
        use_tqdm=False,
    )
    return [o.outputs.data for o in outputs]


def test_dimensions_through_public_and_engine_encode(mean_stack, offline):
    pooling = common_pb2.PoolingParams(dimensions=16)
    reply = mean_stack.public.Encode(
        generation_pb2.EncodeRequest(
            token_ids=[common_pb2.TokenIds(ids=p) for p in PROMPTS], pooling_params=pooling
        ),
        timeout=60,
    )
    for embedding, exp in zip(reply.embeddings, expected(offline, 16), strict=True):
        assert len(embedding.values) == 16
        torch.testing.assert_close(torch.tensor(embedding.values), exp)
    engine_reply = mean_stack.engine_stub.Encode(
        engine_pb2.EngineEncodeRequest(
            request_id="dims-32",
            prompt_token_ids=PROMPTS[1],
            pooling_params=common_pb2.PoolingParams(dimensions=32),
        ),
        timeout=60,
    )
    torch.testing.assert_close(torch.tensor(engine_reply.embedding), expected(offline, 32)[1])
    mean_stack.wait_until_idle()


@pytest.mark.parametrize(
    ("dimensions", "message"),
    [
        (0, "dimensions must be a positive int"),
        (-4, "dimensions must be a positive int"),
        (24, "dimensions=24"),  # not one of the model's Matryoshka dimensions
        (65, "dimensions=65 exceeds the model's hidden size"),
    ],
)
def test_bad_dimensions_are_invalid_argument(mean_stack, dimensions, message):
    pooling = common_pb2.PoolingParams(dimensions=dimensions)
    calls = {
        "public": lambda: mean_stack.public.Encode(
            generation_pb2.EncodeRequest(texts=["hello"], pooling_params=pooling), timeout=30
        ),
        "engine": lambda: mean_stack.engine_stub.Encode(
            engine_pb2.EngineEncodeRequest(
                request_id=f"bad-{dimensions}", prompt_token_ids=[5, 6], pooling_params=pooling
            ),
            timeout=30,
        ),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert message in info.value.details(), (name, info.value.details())
    mean_stack.wait_until_idle()


def test_vllm_embed_pools_the_engines_way(mean_stack, offline):
    vllm = vllm_pb2_grpc.VllmEngineStub(mean_stack.engine_channel)
    reply = vllm.Embed(
        vllm_pb2.EmbedRequest(
            request_id="emb", tokenized=vllm_pb2.TokenizedInput(input_ids=PROMPTS[0])
        ),
        timeout=30,
    )
    assert reply.embedding_dim == 64
    torch.testing.assert_close(torch.tensor(reply.embedding), expected(offline, None)[0])
