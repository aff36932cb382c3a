"""`StructuredOutputsParams`: what a request's output must look like (vLLM's names).

Exactly one of the constraint fields is set. The constraint is a *kind* and a *spec* string
(`key()`), which is also what compiled grammars are cached by: two requests with the same
schema share one compiled grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The constraint fields, in vLLM's order; exactly one is set per request.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One output constraint, as vLLM's `StructuredOutputsParams`.

    - `json`: a JSON schema (a dict, or its text);
    - `json_object`: True for any JSON object;
    - `regex`: the whole output matches it;
    - `choice`: the output is exactly one of these strings;
    - `grammar`: an EBNF (GBNF-style) grammar whose start rule is `root`;
    - `structural_tag`: xgrammar's structural tag (JSON text or dict).

    `disable_any_whitespace` keeps JSON compact (no whitespace between tokens); by default
    the model may put any whitespace where JSON allows it.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        chosen = [name for name in CONSTRAINT_FIELDS if self._is_set(name)]
        if len(chosen) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of "
                f"{', '.join(CONSTRAINT_FIELDS)}; got {len(chosen)}"
                + (f" ({', '.join(chosen)})." if chosen else ".")
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError(f"structured_outputs.json must be a dict or a str, got {self.json!r}.")
        if isinstance(self.json, str):
            _parse_json("structured_outputs.json", self.json)
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(
                f"structured_outputs.regex must be a non-empty str, got {self.regex!r}."
            )
        if self.choice is not None:
            if (
                not isinstance(self.choice, list | tuple)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError(
                    "structured_outputs.choice must be a non-empty list of non-empty strings, "
                    f"got {self.choice!r}."
                )
            self.choice = list(self.choice)
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError(
                f"structured_outputs.grammar must be a non-empty str, got {self.grammar!r}."
            )
        if isinstance(self.structural_tag, str):
            _parse_json("structured_outputs.structural_tag", self.structural_tag)

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        if name == "json_object":
            return bool(value)
        return value is not None

    @property
    def kind(self) -> str:
        """Which constraint field is set."""
        return next(name for name in CONSTRAINT_FIELDS if self._is_set(name))

    def key(self) -> tuple[str, str]:
        """(kind, spec text): the cache key of the compiled grammar."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json_object":
            spec = ""
        elif kind == "choice":
            spec = json.dumps(value)
        elif isinstance(value, dict):
            spec = json.dumps(value, sort_keys=True)
        else:
            spec = value
        if kind in ("json", "json_object") and self.disable_any_whitespace:
            kind += ":compact"
        return kind, spec


def _parse_json(name: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON: {e}.") from None
