"""The tokenizer service's tokenizer without transformers: the `tokenizers` library's Rust
tokenizer read from `tokenizer.json`, the special tokens of `tokenizer_config.json`, and the
chat template rendered with jinja2 (services/tokenizer_service/chat_template.py), as smg's
Rust gateway does. Importing transformers costs the tokenizer process about 3 s of start-up
and most of its memory; this module imports neither it nor torch.

It answers what the service asks of a tokenizer, with transformers' (v5) results:

    tokenizer(text, add_special_tokens=...).input_ids   encode (tokenizer.json's post-processor)
    tokenizer.decode(ids, skip_special_tokens=...)        decode (+ clean-up where configured)
    tokenizer.convert_ids_to_tokens(ids)                  token strings
    tokenizer.apply_chat_template(messages, ...)          the prompt as text
    tokenizer.backend_tokenizer                           the Rust tokenizer (DecodeStream)

`load_light_tokenizer` takes only the files whose meaning is the same here and in
transformers: a `tokenizer.json` whose `tokenizer_class` is the generic one
(`TokenizersBackend`, or `PreTrainedTokenizerFast`, its v4 name). transformers v5 rebuilds the
pipeline of a model-specific class (LlamaTokenizer, Qwen2Tokenizer, GemmaTokenizer, ...) from
its vocabulary with the class's own normalizer and decoder, so those, a tokenizer without
`tokenizer.json` (sentencepiece, tiktoken) and a GGUF file the engine has not converted yet
stay on transformers (services/tokenizer_service/model_files.py), with the reason logged once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from services.tokenizer_service.chat_template import render_chat

# tokenizer_config.json's tokenizer_class values that load tokenizer.json as it is.
GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# transformers' `clean_up_tokenization` (for WordPiece-era models), applied in this order.
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


@dataclass(slots=True)
class Encoding:
    """What `tokenizer(text)` returns, as far as the service reads it."""

    input_ids: list[int]


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_token(value: Any) -> AddedToken | None:
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return AddedToken(
            value["content"],
            single_word=bool(value.get("single_word", False)),
            lstrip=bool(value.get("lstrip", False)),
            rstrip=bool(value.get("rstrip", False)),
            normalized=bool(value.get("normalized", False)),
            special=True,
        )
    return None


class LightTokenizer:
    """A `tokenizers.Tokenizer` with the special tokens and chat template of its model."""

    # `decode` is the backend's (the clean-up aside): engine/api/stream_detokenizer.py may
    # step a `DecodeStream` over the backend instead.
    decodes_with_backend = True

    def __init__(
        self,
        backend: Tokenizer,
        config: Mapping[str, Any],
        chat_template: str | dict[str, str] | None,
    ) -> None:
        self.backend_tokenizer = backend
        self._tokenizer = backend  # transformers' attribute name, which callers also read
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces"))
        # transformers skips the clean-up for BPE models (it would strip real spaces).
        self._clean_up = self.clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"
        self.special_tokens_map = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(config.get(name))) is not None
        }
        for name, text in self.special_tokens_map.items():
            setattr(self, name, text)
        backend.no_truncation()  # transformers encodes without them unless asked
        backend.no_padding()
        # Named and extra special tokens missing from tokenizer.json are added as special
        # tokens, as transformers does when it loads the files.
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        wanted = [config.get(name) for name in SPECIAL_TOKEN_NAMES]
        wanted += list(extra) if isinstance(extra, list) else []
        # `token_to_id` looks in the added tokens, then the model's vocabulary: what
        # `get_vocab(with_added_tokens=True)` holds, without building that dict (the whole
        # vocabulary as Python strings: 36 ms for a 49k vocabulary at every start).
        missing = []
        for value in wanted:
            token = _added_token(value)
            if token is not None and backend.token_to_id(token.content) is None:
                missing.append(token)
        if missing:
            backend.add_tokens(missing)
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self.eos_token_id = backend.token_to_id(self.special_tokens_map.get("eos_token", ""))
        self.bos_token_id = backend.token_to_id(self.special_tokens_map.get("bos_token", ""))

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        encoding = self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return Encoding(encoding.ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self(text, add_special_tokens).input_ids

    def decode(
        self,
        token_ids: list[int] | int,
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        clean_up = (
            self._clean_up
            if clean_up_tokenization_spaces is None
            else clean_up_tokenization_spaces and self._clean_up
        )
        if clean_up:
            for old, new in _CLEAN_UP:
                text = text.replace(old, new)
        return text

    def convert_ids_to_tokens(self, ids: list[int] | int) -> list[str | None] | str | None:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def get_chat_template(self, tools: list[dict[str, Any]] | None = None) -> str:
        template = self.chat_template
        if isinstance(template, dict):
            if tools is not None and "tool_use" in template:
                return template["tool_use"]
            if "default" in template:
                return template["default"]
            raise ValueError(
                f"the model has several chat templates and none named default: {sorted(template)}"
            )
        if template is None:
            raise ValueError("the model has no chat template")
        return template

    def apply_chat_template(
        self,
        conversation: list[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
    ) -> str | list[int]:
        """transformers' `apply_chat_template` for one conversation (tokenized without
        special tokens, as transformers does: the template writes them)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        text = render_chat(
            self.get_chat_template(tools),
            list(conversation),
            self.special_tokens_map,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
        )
        return self(text, add_special_tokens=False).input_ids if tokenize else text


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def read_chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The chat template(s) as transformers finds them: `chat_template.jinja` and
    `additional_chat_templates/*.jinja` first, then `chat_template.json`, then the config."""
    templates: dict[str, str] = {}
    single = model_dir / "chat_template.jinja"
    if single.is_file():
        templates["default"] = single.read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    if not templates:
        raw = _read_json(model_dir / "chat_template.json").get("chat_template")
        raw = raw if raw is not None else config.get("chat_template")
        if isinstance(raw, list):
            return {t["name"]: t["template"] for t in raw}
        return raw if isinstance(raw, str) else None
    if list(templates) == ["default"]:
        return templates["default"]
    return templates


def light_unsupported(model_dir: Path) -> str | None:
    """Why `model_dir`'s tokenizer needs transformers, or None when this module reads it."""
    if not (model_dir / "tokenizer.json").is_file():
        return "no tokenizer.json (a sentencepiece or tiktoken tokenizer)"
    config = _read_json(model_dir / "tokenizer_config.json")
    cls = config.get("tokenizer_class")
    if cls not in GENERIC_CLASSES:
        return f"tokenizer_class {cls!r} rebuilds its pipeline in transformers"
    if config.get("auto_map"):
        return "the tokenizer is remote code (auto_map)"
    if config.get("fix_mistral_regex"):
        return "fix_mistral_regex asks transformers to patch the pre-tokenizer"
    return None


class LightUnsupported(ValueError):
    """The files need transformers' tokenizer; the message says why."""


def _check_added_tokens(backend: Tokenizer, config: Mapping[str, Any]) -> None:
    """tokenizer_config.json's `added_tokens_decoder` must agree with tokenizer.json (both
    written by one save): transformers would add a token it lacks, at an id of its choosing."""
    decoder = config.get("added_tokens_decoder") or {}
    for index, token in decoder.items():
        content = _token_text(token)
        if content is None or backend.token_to_id(content) != int(index):
            raise LightUnsupported(
                f"added_tokens_decoder[{index}] = {content!r} is not that id in tokenizer.json"
            )


def load_light_tokenizer(model_dir: Path) -> LightTokenizer:
    """The light tokenizer of `model_dir`; LightUnsupported where it needs transformers."""
    reason = light_unsupported(model_dir)
    if reason is not None:
        raise LightUnsupported(reason)
    config = _read_json(model_dir / "tokenizer_config.json")
    backend = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    _check_added_tokens(backend, config)
    return LightTokenizer(backend, config, read_chat_template(model_dir, config))
