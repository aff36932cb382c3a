"""Tokenize, Detokenize, GetModelInfo, Encode and Abort of unknown ids on the public API."""

from __future__ import annotations

import copy

import grpc
import pytest
import torch

from pagedserve.v1 import common_pb2, generation_pb2
from services.engine_service.servicer import model_info_from_config


def test_tokenize_and_detokenize(stack, offline_llm):
    tokenizer = offline_llm.get_tokenizer()
    reply = stack.public.Tokenize(generation_pb2.TokenizeRequest(text="Hello world"))
    assert list(reply.token_ids) == tokenizer("Hello world").input_ids
    assert list(reply.tokens) == tokenizer.convert_ids_to_tokens(list(reply.token_ids))
    assert reply.count == len(reply.token_ids) and reply.max_model_len == 4096
    chat = generation_pb2.ChatInput(
        messages=[generation_pb2.ChatMessage(role="user", content="hi")]
    )
    rendered = stack.public.Tokenize(generation_pb2.TokenizeRequest(chat=chat))
    assert tokenizer.decode(rendered.token_ids).endswith("<|im_start|>assistant\n")

    text = stack.public.Detokenize(generation_pb2.DetokenizeRequest(token_ids=reply.token_ids))
    assert text.text == "Hello world"
    with pytest.raises(grpc.RpcError) as info:
        stack.public.Detokenize(generation_pb2.DetokenizeRequest(token_ids=[1, 10**6]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids[1]" in info.value.details()


def test_model_info(stack):
    info = stack.public.GetModelInfo(common_pb2.GetModelInfoRequest())
    assert info == stack.engine_stub.GetModelInfo(common_pb2.GetModelInfoRequest())
    assert (info.vocab_size, info.max_model_len, info.hidden_size) == (49152, 4096, 64)
    assert list(info.eos_token_ids) == [2] and info.architecture == "LlamaForCausalLM"
    assert info.num_kv_blocks > 0 and info.block_size == 16
    # The cache holds more than one whole-length request: the model's length is the limit.
    assert info.num_kv_blocks * info.block_size >= 4096
    assert info.effective_max_model_len == 4096 and info.max_logprobs == 20


def test_model_info_reports_the_length_a_small_cache_allows(stack):
    config = copy.deepcopy(stack.loop.run(stack.engine.get_engine_config()))
    config.cache_config.num_blocks = 10  # 160 tokens of cache for a 4096-token model
    info = model_info_from_config(config)
    assert (info.max_model_len, info.effective_max_model_len) == (4096, 160)


def test_encode_matches_offline(stack, offline_llm):
    texts = ["Hello world", "The capital of France is"]
    reply = stack.public.Encode(generation_pb2.EncodeRequest(texts=texts))
    expected = offline_llm.encode(texts, use_tqdm=False)
    assert len(reply.embeddings) == 2
    for embedding, exp in zip(reply.embeddings, expected):
        torch.testing.assert_close(torch.tensor(embedding.values), exp.outputs.data)
        assert embedding.prompt_tokens == len(exp.prompt_token_ids)
    assert reply.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    with pytest.raises(grpc.RpcError) as info:
        stack.public.Encode(generation_pb2.EncodeRequest())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_abort_of_unknown_ids_is_empty(stack):
    reply = stack.public.Abort(common_pb2.AbortRequest(request_ids=["nope"]))
    assert list(reply.aborted_request_ids) == []
