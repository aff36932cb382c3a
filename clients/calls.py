"""The client API's methods, once for both transports: each turns its keyword arguments into
a call plan (the request message, how to read the reply, the retry policy), which `Client`
runs over grpc and `AsyncClient` over grpc.aio.

    client.encode("hi", dimensions=8)
      └─ calls.encode(...)  → UnaryCall("Encode", EncodeRequest, embeddings_from_proto)
           └─ Client._unary(call) / await AsyncClient._unary(call): send, retry, parse

The functions' names, signatures and docstrings are the methods' (`core.method_of` gives them
to the transports' methods), so this file is where an argument or a method is added.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from clients import requests
from clients.channel import NO_RETRY, RetryPolicy
from clients.outputs import (
    HealthStatus,
    LoraAdapter,
    ModelInfo,
    TokenizeResult,
    aborted_ids_from_proto,
    embeddings_from_proto,
    health_from_proto,
    lora_adapters_from_proto,
    model_info_from_proto,
    tokenize_from_proto,
)
from pagedserve.v1 import common_pb2, generation_pb2

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from clients.requests import Message, SamplingKwargs

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class UnaryCall(Generic[T]):
    """One unary RPC to make: `rpc` is its name on the stub; `parse` turns the reply into what
    the method returns; `retry` None means the client's policy."""

    rpc: str
    request: Any
    parse: Callable[[Any], T]
    timeout: float | None
    retry: RetryPolicy | None = None


@dataclass(frozen=True, slots=True)
class GenerateCall:
    """The Generate stream to open; the transport's stream object reads it."""

    request: generation_pb2.GenerateRequest
    timeout: float | None


# ---- generation -------------------------------------------------------------------------


def generate(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[Message] | None = None,
    request_id: str = "",
    priority: int = 0,
    trace_headers: Mapping[str, str] | None = None,
    timeout: float | None = None,
    add_special_tokens: bool | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool | None = None,
    lora_name: str = "",
    **sampling: Unpack[SamplingKwargs],
) -> GenerateCall:
    """Streams the answer to one prompt: a text `prompt`, `token_ids`, or chat
    `messages` (rendered with the model's chat template). Sampling keyword arguments are
    `SamplingParams` fields (vLLM's names); unset ones take the server's defaults.
    Iterate the stream (`async for` with `AsyncClient`); leaving the loop early cancels it."""
    request = generation_pb2.GenerateRequest(
        request_id=request_id,
        lora_name=lora_name,
        sampling_params=requests.sampling_params(**sampling),
        priority=priority,
        trace_headers=dict(trace_headers or {}),
        add_special_tokens=add_special_tokens,
    )
    kind = requests.one_input(prompt=prompt, token_ids=token_ids, messages=messages)
    if kind == "prompt":
        request.text = prompt
    elif kind == "token_ids":
        request.token_ids.SetInParent()  # selects the input even for an empty list
        request.token_ids.ids.extend(token_ids)
    else:
        chat = requests.chat_input(messages, add_generation_prompt, continue_final_message)
        request.chat.CopyFrom(chat)
    return GenerateCall(request, timeout)


def abort(
    request_ids: str | Iterable[str], *, timeout: float | None = None
) -> UnaryCall[list[str]]:
    """Aborts requests by id; returns the ids that were live (their streams end with
    finish_reason "abort")."""
    ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
    request = common_pb2.AbortRequest(request_ids=ids)
    return UnaryCall("Abort", request, aborted_ids_from_proto, timeout)


# ---- embeddings, text, health -------------------------------------------------------------


def encode(
    texts: str | Sequence[str] | None = None,
    *,
    token_ids: Sequence[Sequence[int]] | None = None,
    normalize: bool | None = None,
    dimensions: int | None = None,
    request_id: str = "",
    trace_headers: Mapping[str, str] | None = None,
    timeout: float | None = None,
    lora_name: str = "",
) -> UnaryCall[list[list[float]]]:
    """One pooled embedding per text (or per token-id list), in input order; with
    `dimensions`, Matryoshka embeddings cut to that size before normalisation."""
    requests.one_input(texts=texts, token_ids=token_ids)
    request = generation_pb2.EncodeRequest(
        request_id=request_id,
        lora_name=lora_name,
        texts=[texts] if isinstance(texts, str) else list(texts or []),
        token_ids=[common_pb2.TokenIds(ids=ids) for ids in token_ids or []],
        pooling_params=common_pb2.PoolingParams(normalize=normalize, dimensions=dimensions),
        trace_headers=dict(trace_headers or {}),
    )
    return UnaryCall("Encode", request, embeddings_from_proto, timeout)


def tokenize(
    text: str | None = None,
    *,
    messages: Sequence[Message] | None = None,
    add_special_tokens: bool | None = None,
    timeout: float | None = None,
) -> UnaryCall[TokenizeResult]:
    """The token ids and token strings of a text (or of chat `messages`, rendered)."""
    if requests.one_input(text=text, messages=messages) == "text":
        request = generation_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
    else:
        request = generation_pb2.TokenizeRequest(chat=requests.chat_input(messages))
    return UnaryCall("Tokenize", request, tokenize_from_proto, timeout)


def detokenize(
    token_ids: Sequence[int],
    *,
    skip_special_tokens: bool | None = None,
    timeout: float | None = None,
) -> UnaryCall[str]:
    """The text of `token_ids`."""
    request = generation_pb2.DetokenizeRequest(
        token_ids=token_ids, skip_special_tokens=skip_special_tokens
    )
    return UnaryCall("Detokenize", request, operator.attrgetter("text"), timeout)


def health(*, timeout: float | None = None) -> UnaryCall[HealthStatus]:
    """The server's own health (not retried: an unreachable server raises
    UnavailableError at once)."""
    request = common_pb2.HealthRequest()
    return UnaryCall("Health", request, health_from_proto, timeout, NO_RETRY)


def model_info(*, timeout: float | None = None) -> UnaryCall[ModelInfo]:
    """The served model: its name, vocabulary, context length, KV-cache size, ..."""
    request = common_pb2.GetModelInfoRequest()
    return UnaryCall("GetModelInfo", request, model_info_from_proto, timeout)


# ---- LoRA adapters (admin RPCs: an admin key when the server has API keys) ---------------


def load_lora_adapter(
    lora_name: str, lora_path: str, *, timeout: float | None = None
) -> UnaryCall[int]:
    """Loads a PEFT adapter directory (a path on the engines' hosts) on every engine
    replica under `lora_name`; returns its id. Not retried: a retry could find it
    loaded."""
    request = common_pb2.LoadLoraAdapterRequest(lora_name=lora_name, lora_path=lora_path)
    return UnaryCall(
        "LoadLoraAdapter", request, operator.attrgetter("lora_int_id"), timeout, NO_RETRY
    )


def unload_lora_adapter(lora_name: str, *, timeout: float | None = None) -> UnaryCall[None]:
    """Unloads the adapter from every engine replica. Not retried."""
    request = common_pb2.UnloadLoraAdapterRequest(lora_name=lora_name)
    return UnaryCall("UnloadLoraAdapter", request, _nothing, timeout, NO_RETRY)


def list_lora_adapters(*, timeout: float | None = None) -> UnaryCall[list[LoraAdapter]]:
    """The adapters loaded on every engine replica."""
    request = common_pb2.ListLoraAdaptersRequest()
    return UnaryCall("ListLoraAdapters", request, lora_adapters_from_proto, timeout)


def _nothing(reply: Any) -> None:
    return None
