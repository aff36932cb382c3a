"""The grammar engine behind structured outputs: xgrammar (see docs/structured_outputs.md
for why xgrammar over llguidance, with the measurements).

Two steps per constraint, split by cost:

- `check(params)`: parses the spec into an xgrammar `Grammar` without the tokenizer
  (milliseconds). `add_request` calls it, so a spec the library rejects fails the request
  at once with the library's reason (ValueError -> INVALID_ARGUMENT over gRPC).
- `compile(params)`: builds the token-level automaton over the whole vocabulary (tens of
  milliseconds to seconds). It runs on the manager's thread pool, never in the engine step.

A `GrammarMatcher` is one request's position in its grammar: it fills the request's row of
the batch bitmask, accepts sampled tokens, and rolls back rejected speculative drafts.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from engine.api.structured_outputs import StructuredOutputsParams

BACKEND_NAME = "xgrammar"
# xgrammar prefixes its messages with a time and its C++ source location: not for users.
_LOG_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")
_COMPILER_THREADS = 2  # per compilation; compilations also run on a pool of their own


class XgrammarBackend:
    """Compiles constraints for one tokenizer and vocabulary size (the model's, which may
    exceed the tokenizer's: padded ids are never allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(
            info, max_threads=_COMPILER_THREADS, cache_enabled=False
        )

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The token-level grammar; ValueError with xgrammar's reason if it rejects the spec."""
        try:
            return self.compiler.compile_grammar(build_grammar(params))
        except (RuntimeError, ValueError, TypeError) as e:
            raise _rejected(params, e) from None

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> GrammarMatcher:
        return GrammarMatcher(xgr.GrammarMatcher(compiled))


def check(params: StructuredOutputsParams) -> None:
    """Raises ValueError (naming the field, with xgrammar's reason) if the spec is invalid."""
    try:
        build_grammar(params)
    except (RuntimeError, ValueError, TypeError) as e:
        raise _rejected(params, e) from None


def _rejected(params: StructuredOutputsParams, error: Exception) -> ValueError:
    reason = _LOG_PREFIX.sub("", str(error)).strip()
    return ValueError(f"structured_outputs.{params.kind} was rejected by xgrammar: {reason}")


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The tokenizer-independent grammar of a constraint."""
    kind = params.kind
    compact = params.disable_any_whitespace
    if kind == "json":
        schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return xgr.Grammar.from_json_schema(schema, any_whitespace=not compact, strict_mode=True)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema(
            '{"type": "object"}', any_whitespace=not compact, strict_mode=False
        )
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        # One EBNF alternative per choice; JSON string escaping is valid EBNF escaping.
        alternatives = " | ".join(json.dumps(c) for c in params.choice)  # type: ignore[union-attr]
        return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(params.grammar)
    return _structural_tag_grammar(params.structural_tag)


def _structural_tag_grammar(tag: str | dict[str, Any] | None) -> xgr.Grammar:
    """xgrammar's structural tag (`{"type": "structural_tag", "format": ...}`), or the
    older form vLLM's OpenAI API still accepts: `{"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}`, read as xgrammar's tag items and triggers."""
    spec = json.loads(tag) if isinstance(tag, str) else tag
    if isinstance(spec, dict) and "structures" in spec:
        structures, triggers = spec["structures"], spec.get("triggers", [])
        if not (
            isinstance(structures, list)
            and all(isinstance(s, dict) and {"begin", "end"} <= s.keys() for s in structures)
            and isinstance(triggers, list)
        ):
            raise ValueError(
                "structures must be a list of {begin, schema, end} objects and triggers a list"
            )
        items = [
            xgr.StructuralTagItem(
                begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"]
            )
            for s in structures
        ]
        return xgr.Grammar.from_structural_tag(items, triggers)
    return xgr.Grammar.from_structural_tag(json.dumps(spec))


class GrammarMatcher:
    """One request's state in its grammar."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        """Advances over `token_id`; False (state unchanged) if the grammar forbids it."""
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]` ([B, ceil(V / 32)] int32)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
