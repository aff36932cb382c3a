"""The tokenizer service's side of a request before the engine sees it: chat templates,
tokenization, the model's defaults, and the checks that need text or the tokenizer. Every
rejection is INVALID_ARGUMENT with a message that names the field by its proto path
(`text`, `chat.messages[1].role`, ...). Token ids and sampling values are the engine's to
check (services/tokenizer_service/sampling.py says why).

Defaults: a field the caller leaves unset takes the model's generation_config value, then
vLLM's default (`engine.SamplingParams`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedserve.v1 import common_pb2, generation_pb2
from services.common.errors import invalid_argument
from services.tokenizer_service.sampling import RequestSampling

CHAT_ROLES = ("system", "user", "assistant")


class Preprocessor:
    """Turns public requests into prompt token ids and their sampling parameters."""

    def __init__(
        self,
        tokenizer: Any,
        defaults: Mapping[str, Any],
        vocab_size: int,
        max_model_len: int,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.defaults = dict(defaults)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_prompt_tokens = min(max_prompt_tokens or max_model_len, max_model_len)

    # ---- prompts ----------------------------------------------------------------------

    def prompt_token_ids(self, request: generation_pb2.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "text":
            add_special = (
                request.add_special_tokens if request.HasField("add_special_tokens") else True
            )
            ids = self.encode_text(request.text, add_special, "text")
        elif kind == "chat":
            ids = self.encode_chat(request.chat)
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)  # the engine checks them against its vocabulary
        else:
            raise invalid_argument("input must be set: one of text, chat or token_ids")
        sampling = request.sampling_params
        if sampling.HasField("truncate_prompt_tokens") and sampling.truncate_prompt_tokens > 0:
            ids = ids[-sampling.truncate_prompt_tokens :]  # vLLM: keep the last k tokens
        return self.check_prompt_length(ids, kind)

    def encode_text(self, text: str, add_special_tokens: bool, field: str) -> list[int]:
        if not text:
            raise invalid_argument(f"{field} must not be empty")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def render_chat(self, chat: generation_pb2.ChatInput) -> str:
        """The chat rendered with the model's template, as text."""
        if not chat.messages:
            raise invalid_argument("chat.messages must not be empty")
        for i, message in enumerate(chat.messages):
            if not message.role:
                raise invalid_argument(f"chat.messages[{i}].role must not be empty")
            if message.role not in CHAT_ROLES:
                raise invalid_argument(
                    f"chat.messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                    f"got {message.role!r}"
                )
        continue_final = chat.continue_final_message
        add_generation_prompt = (
            chat.add_generation_prompt
            if chat.HasField("add_generation_prompt")
            else not continue_final
        )
        if continue_final and add_generation_prompt:
            raise invalid_argument(
                "chat.continue_final_message and chat.add_generation_prompt cannot both be true"
            )
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise invalid_argument("chat: the model has no chat template; send text instead")
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final,
                tokenize=False,
            )
        except Exception as exc:  # the template's own checks (e.g. alternating roles)
            raise invalid_argument(f"chat.messages: the chat template rejects them: {exc}") from exc

    def encode_chat(self, chat: generation_pb2.ChatInput) -> list[int]:
        # The template already holds the special tokens (as `LLM.chat` does).
        return list(self.tokenizer(self.render_chat(chat), add_special_tokens=False).input_ids)

    def check_token_ids(self, token_ids: Sequence[int], field: str) -> list[int]:
        ids = list(token_ids)
        for i, token_id in enumerate(ids):
            if token_id >= self.vocab_size:
                raise invalid_argument(
                    f"{field}[{i}] = {token_id} is not in the vocabulary [0, {self.vocab_size})"
                )
        return ids

    def check_prompt_length(self, ids: list[int], field: str) -> list[int]:
        """This service's own limit, `max_prompt_tokens`, when it is below the model's
        length; an empty prompt, one over `max_model_len` or one the KV cache can never hold
        is the engine's to reject."""
        if self.max_prompt_tokens < self.max_model_len and len(ids) > self.max_prompt_tokens:
            raise invalid_argument(
                f"{field}: the prompt has {len(ids)} tokens, more than the limit of "
                f"{self.max_prompt_tokens} (max_prompt_tokens)"
            )
        return ids

    # ---- sampling parameters ----------------------------------------------------------

    def sampling(self, msg: common_pb2.SamplingParams) -> RequestSampling:
        """The caller's fields over the model's defaults (services/tokenizer_service/
        sampling.py); their values are the engine's to check."""
        return RequestSampling(msg, self.defaults)
