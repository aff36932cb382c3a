"""Keyword arguments → parts of the API's request messages: the sampling parameters, a chat,
the one input of a request (`clients.calls` builds the whole requests with them).

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


def one_input(**inputs: Any) -> str:
    """The name of the one input given (not None) among `inputs`."""
    given = [name for name, value in inputs.items() if value is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of {', '.join(inputs)} (got {len(given)})")
    return given[0]
