"""Keyword arguments → the API's request messages (shared by `Client` and `AsyncClient`).

Sampling keyword arguments are `SamplingParams` fields with vLLM's names (`SamplingKwargs`);
one left out (or None) stays unset, so the server applies the model's generation_config
default, then vLLM's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import grpc

from clients.errors import InvalidArgumentError
from pagedserve.v1 import common_pb2, generation_pb2

Message = Mapping[str, str]  # {"role": "user", "content": "..."}


class SamplingKwargs(TypedDict, total=False):
    """The sampling keyword arguments `generate`, `generate_text` and `chat` take."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    max_tokens: int
    min_tokens: int
    stop: str | Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    spaces_between_special_tokens: bool
    logit_bias: Mapping[int, float]
    allowed_token_ids: Sequence[int]
    bad_words: Sequence[str]
    truncate_prompt_tokens: int
    # Structured outputs: at most one of these (the `constraint` oneof).
    json_schema: str | Mapping[str, Any]  # a JSON schema, as text or a dict
    json_object: bool
    regex: str
    grammar: str
    structural_tag: str
    choice: Sequence[str]
    disable_any_whitespace: bool


SAMPLING_FIELDS: tuple[str, ...] = tuple(SamplingKwargs.__annotations__)
# Filled by the tokenizer service for the engine, never by a client.
_SERVICE_FIELDS = {"bad_words_token_ids"}
assert set(SAMPLING_FIELDS) | _SERVICE_FIELDS == set(
    common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
)
_REPEATED = ("stop", "stop_token_ids", "allowed_token_ids", "bad_words")


def _invalid(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, message)


def sampling_params(**kwargs: Any) -> common_pb2.SamplingParams:
    """The `SamplingParams` message for `kwargs`; an unknown name is a TypeError, a value
    the message cannot hold (a negative `max_tokens`) an InvalidArgumentError."""
    unknown = sorted(set(kwargs) - set(SAMPLING_FIELDS))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(unknown)}; sampling arguments are "
            f"{', '.join(SAMPLING_FIELDS)}"
        )
    msg = common_pb2.SamplingParams()
    for name, value in kwargs.items():
        if value is None:
            continue
        if name == "stop" and isinstance(value, str):
            value = [value]
        if name == "json_schema" and not isinstance(value, str):
            value = json.dumps(value)
        try:
            if name in _REPEATED:
                getattr(msg, name).extend(value)
            elif name == "logit_bias":
                msg.logit_bias.update(value)
            elif name == "choice":
                msg.choice.choices.extend(value)
            else:
                setattr(msg, name, value)
        except (TypeError, ValueError) as exc:
            raise _invalid(f"sampling_params.{name} = {value!r} is not valid: {exc}") from None
    return msg


def chat_input(
    messages: Sequence[Message],
    add_generation_prompt: bool | None = None,
    continue_final_message: bool | None = None,
) -> generation_pb2.ChatInput:
    chat = generation_pb2.ChatInput(
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise _invalid(f"chat.messages[{i}] must be a mapping with role and content")
        chat.messages.add(role=message.get("role", ""), content=message.get("content", ""))
    return chat


def _one_input(**inputs: Any) -> str:
    given = [name for name, value in inputs.items() if value is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of {', '.join(inputs)} (got {len(given)})")
    return given[0]


def generate_request(
    prompt: str | None = None,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[Message] | None = None,
    *,
    request_id: str = "",
    priority: int = 0,
    trace_headers: Mapping[str, str] | None = None,
    add_special_tokens: bool | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool | None = None,
    lora_name: str = "",
    **sampling: Any,
) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(
        request_id=request_id,
        lora_name=lora_name,
        sampling_params=sampling_params(**sampling),
        priority=priority,
        trace_headers=dict(trace_headers or {}),
        add_special_tokens=add_special_tokens,
    )
    kind = _one_input(prompt=prompt, token_ids=token_ids, messages=messages)
    if kind == "prompt":
        request.text = prompt
    elif kind == "token_ids":
        request.token_ids.SetInParent()  # selects the input even for an empty list
        request.token_ids.ids.extend(token_ids)
    else:
        request.chat.CopyFrom(chat_input(messages, add_generation_prompt, continue_final_message))
    return request


def encode_request(
    texts: str | Sequence[str] | None = None,
    token_ids: Sequence[Sequence[int]] | None = None,
    *,
    normalize: bool | None = None,
    dimensions: int | None = None,
    request_id: str = "",
    trace_headers: Mapping[str, str] | None = None,
    lora_name: str = "",
) -> generation_pb2.EncodeRequest:
    _one_input(texts=texts, token_ids=token_ids)
    return generation_pb2.EncodeRequest(
        request_id=request_id,
        lora_name=lora_name,
        texts=[texts] if isinstance(texts, str) else list(texts or []),
        token_ids=[common_pb2.TokenIds(ids=ids) for ids in token_ids or []],
        pooling_params=common_pb2.PoolingParams(normalize=normalize, dimensions=dimensions),
        trace_headers=dict(trace_headers or {}),
    )


def tokenize_request(
    text: str | None = None,
    messages: Sequence[Message] | None = None,
    *,
    add_special_tokens: bool | None = None,
    add_generation_prompt: bool | None = None,
) -> generation_pb2.TokenizeRequest:
    if _one_input(text=text, messages=messages) == "text":
        return generation_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
    return generation_pb2.TokenizeRequest(chat=chat_input(messages, add_generation_prompt))
