"""What one request may cost, checked before anything is tokenized or sent on.

A request within the message-size limit can still ask for work without bound: a megabyte
prompt (tokenizing it holds the event loop), n = 3000 samples (the engine thread stalls),
a uint32 max_tokens, twenty thousand stop strings (every delta is searched for each).
Each check raises INVALID_ARGUMENT naming the field and the limit:

    text, chat.messages[i].content, texts[i]   max_prompt_bytes (UTF-8 bytes; 1 MiB)
    chat.messages                              max_chat_messages (how many; 1024)
    token_ids (Detokenize)                     max_model_len (token ids)
    texts + token_ids (Encode)                 max_encode_inputs (256)
    sampling_params.n                          max_n (16)
    sampling_params.max_tokens                 max_model_len
    sampling_params.stop                       max_stop_strings (64),
                                               each max_stop_string_bytes (1 KiB),
                                               and none empty (vLLM's rule: the stop
                                               strings never reach the engine)

Token ids of a prompt and every sampling value are the engine's to check (one message per
rule, on every path to the engine: services/tokenizer_service/sampling.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.v1 import common_pb2, generation_pb2
from services.common.errors import invalid_argument


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_prompt_bytes: int = 1 << 20
    max_chat_messages: int = 1024
    max_encode_inputs: int = 256
    max_n: int = 16
    max_stop_strings: int = 64
    max_stop_string_bytes: int = 1024

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class RequestChecker:
    """The limits, with what the engine told us (`ModelInfo`)."""

    limits: RequestLimits
    max_model_len: int

    def check_generate(self, request: generation_pb2.GenerateRequest) -> None:
        kind = request.WhichOneof("input")
        if kind == "text":
            self.check_text(request.text, "text")
        elif kind == "chat":
            self.check_chat(request.chat, "chat")
        self.check_sampling(request.sampling_params)

    def check_tokenize(self, request: generation_pb2.TokenizeRequest) -> None:
        if request.WhichOneof("input") == "text":
            self.check_text(request.text, "text")
        elif request.WhichOneof("input") == "chat":
            self.check_chat(request.chat, "chat")

    def check_encode(self, request: generation_pb2.EncodeRequest) -> None:
        num_inputs = len(request.texts) + len(request.token_ids)
        if num_inputs > self.limits.max_encode_inputs:
            raise invalid_argument(
                f"texts, token_ids: {num_inputs} inputs, more than the limit "
                f"max_encode_inputs={self.limits.max_encode_inputs}"
            )
        for i, text in enumerate(request.texts):
            self.check_text(text, f"texts[{i}]")

    def check_text(self, text: str, field: str) -> None:
        # 4 bytes per character at most: only long texts need encoding to count bytes.
        if len(text) * 4 <= self.limits.max_prompt_bytes:
            return
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        if num_bytes > self.limits.max_prompt_bytes:
            raise invalid_argument(
                f"{field}: {num_bytes} bytes, more than the limit "
                f"max_prompt_bytes={self.limits.max_prompt_bytes}"
            )

    def check_chat(self, chat: generation_pb2.ChatInput, field: str) -> None:
        num = len(chat.messages)
        if num > self.limits.max_chat_messages:
            raise invalid_argument(
                f"{field}.messages: {num} messages, more than the limit "
                f"max_chat_messages={self.limits.max_chat_messages}"
            )
        total = sum(len(m.content) for m in chat.messages)
        if total * 4 > self.limits.max_prompt_bytes:
            num_bytes = sum(len(m.content.encode("utf-8", "surrogatepass")) for m in chat.messages)
            if num_bytes > self.limits.max_prompt_bytes:
                raise invalid_argument(
                    f"{field}.messages: their contents hold {num_bytes} bytes, more than the "
                    f"limit max_prompt_bytes={self.limits.max_prompt_bytes}"
                )

    def check_token_ids(self, ids: Sequence[int], field: str) -> None:
        if len(ids) > self.max_model_len:
            raise invalid_argument(
                f"{field}: {len(ids)} token ids, more than the model's length "
                f"max_model_len={self.max_model_len}"
            )

    def check_sampling(self, params: common_pb2.SamplingParams) -> None:
        limits = self.limits
        if params.HasField("n") and params.n > limits.max_n:
            raise invalid_argument(f"sampling_params.n={params.n} exceeds max_n={limits.max_n}")
        if params.HasField("max_tokens") and params.max_tokens > self.max_model_len:
            raise invalid_argument(
                f"sampling_params.max_tokens={params.max_tokens} exceeds the model's length "
                f"max_model_len={self.max_model_len}"
            )
        if len(params.stop) > limits.max_stop_strings:
            raise invalid_argument(
                f"sampling_params.stop: {len(params.stop)} stop strings, more than the limit "
                f"max_stop_strings={limits.max_stop_strings}"
            )
        for i, stop in enumerate(params.stop):
            # Stop strings never reach the engine (they are matched here, on text), so this
            # side checks them as vLLM's SamplingParams does.
            if not stop:
                raise invalid_argument(
                    f"sampling_params.stop[{i}]: stop cannot contain an empty string"
                )
            if len(stop.encode("utf-8", "surrogatepass")) > limits.max_stop_string_bytes:
                raise invalid_argument(
                    f"sampling_params.stop[{i}]: longer than the limit "
                    f"max_stop_string_bytes={limits.max_stop_string_bytes}"
                )
