"""A model's chat template rendered with jinja2 directly, as transformers' `apply_chat_template`
renders it (transformers/utils/chat_template_utils.py), without importing transformers.

The environment is the same: an immutable sandbox (templates come from model files, untrusted
code), `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, the `{% generation %}`
tag (rendered as its body: nothing here asks for the assistant mask), and the globals and
filters templates rely on (`raise_exception`, `strftime_now`, `tojson` without HTML escaping,
a `dict` and a `namespace` that refuse private names). A template sees `messages`, `tools`,
`documents`, `add_generation_prompt` and the named special tokens (`bos_token`, `eos_token`,
...), and `continue_final_message` cuts the text after the last message's content as
transformers does. tests/services/tokenizer_service/test_light_tokenizer.py compares the text
with transformers' for the templates of several model families.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# transformers' marker for the end of the message to continue (note the trailing space).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Names a message's reasoning is passed under; templates read the first (gpt-oss: `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask templates): the body as is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` for templates, without the type's attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names (no reach into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _alias_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    aliased = []
    for message in messages:
        reasoning = next(
            (message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def render_chat(
    source: str,
    messages: list[Mapping[str, Any]],
    special_tokens: Mapping[str, str],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation as text. Raises jinja2's TemplateError for the template's own checks
    and ValueError where transformers does (a final message the template drops)."""
    # Keys whose value is None are dropped (transformers: templates handle a missing key).
    chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
    chat = _alias_reasoning(chat)
    final = ""
    if continue_final_message:
        if not chat or chat[-1].get("content") is None:
            raise ValueError("continue_final_message is set but the final message has no content")
        if "content" not in source:
            raise ValueError("continue_final_message: the chat template reads no content")
        final = chat[-1]["content"]
        if not isinstance(final, str):
            raise ValueError("continue_final_message needs the final message's content as text")
        chat[-1] = {**chat[-1], "content": final + _CONTINUE_TAG}
    rendered = compile_template(source).render(
        messages=chat,
        tools=tools,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        **special_tokens,
    )
    if not continue_final_message:
        return rendered
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space
