"""A request's structured-output state, as the scheduler and the runner see it.

No torch and no grammar library here: the scheduler only asks `is_ready()` (has the grammar
compiled?) and hands accepted tokens to `accept_tokens`; the runner asks for the matcher to
fill the request's bitmask row.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class StructuredOutputRequest:
    """The compiled grammar (a future from the compile pool) and, once it has arrived, the
    request's own matcher (each of the n samples has one; they share the compiled grammar)."""

    def __init__(
        self,
        compiled: Future[Any],
        new_matcher: Callable[[Any], Any],
        resumed_token_ids: list[int] | None = None,
        on_refused: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._compiled = compiled
        self._new_matcher = new_matcher
        # A resumed request's output so far (engine/processing/resume.py): the new matcher is
        # advanced
        # over it before the request may be scheduled; `on_refused` hears if it cannot be.
        self._resumed_token_ids = resumed_token_ids or []
        self._on_refused = on_refused
        self._refused: BaseException | None = None
        self.matcher: Any = None  # engine.structured_output.backend.GrammarMatcher

    def is_ready(self) -> bool:
        """True once the grammar compiled (the matcher exists) or failed to compile
        (`error`); never for resumed tokens the grammar refuses (the engine aborts it)."""
        if self.matcher is not None:
            return True
        if self._refused is not None or not self._compiled.done():
            return False
        if self._compiled.exception() is None:
            matcher = self._new_matcher(self._compiled.result())
            if not all(matcher.accept_token(t) for t in self._resumed_token_ids):
                self._refused = ValueError(
                    "resumed_output_token_ids: the grammar refuses the output so far."
                )
                if self._on_refused is not None:
                    self._on_refused(self._refused)
                return False
            self.matcher = matcher
        return True

    @property
    def error(self) -> BaseException | None:
        if self._refused is not None:
            return self._refused
        if not self._compiled.done():
            return None
        return self._compiled.exception()

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advances the grammar over accepted tokens; False at the first one it forbids."""
        return all(self.matcher.accept_token(t) for t in token_ids)

    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()
