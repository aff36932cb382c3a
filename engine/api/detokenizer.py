"""Incremental detokenization and stop strings for one output sequence."""

from __future__ import annotations

from typing import Any

# Tokens of the prompt's tail decoded with the first output tokens, so that a leading
# space or a multi-byte character that spans the boundary comes out right.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, a few tokens at a time.

    Two offsets into `self.token_ids` keep the work per token constant::

        token_ids: [ ...prompt tail... | out0 out1 out2 | out3 ]
                     ^prefix_offset     ^read_offset
        text so far = decode(prefix:read); new text = decode(prefix:) minus that

    New text is held back while it ends in U+FFFD (half of a UTF-8 character).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        # A streamed delta withholds this many characters that might start a stop string.
        self.stop_buffer_length = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def update(self, new_token_ids: list[int]) -> str | None:
        """Adds tokens; returns the stop string that matched, if any (text is cut there)."""
        if not self.stop:  # the common case, once per token on the tokenizer service
            self._append(new_token_ids)
            return None
        start = len(self.output_text)
        self._append(new_token_ids)
        return self._check_stop_strings(start)

    def append_resumed(self, token_ids: list[int]) -> None:
        """Adds output tokens generated before the request was resumed here: their text is
        output, but stop strings are only looked for in what `update` adds later (a match
        that starts in this text and ends in a later token still counts)."""
        self._append(token_ids)

    def _append(self, new_token_ids: list[int]) -> None:
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.token_ids[self.prefix_offset :])
            if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
                self.output_text += new_text[len(prefix_text) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.token_ids)

    def _check_stop_strings(self, new_text_start: int) -> str | None:
        if not self.stop or len(self.output_text) == new_text_start:
            return None
        # Only a match that ends in the new text can be new.
        window_start = max(0, new_text_start - self.stop_buffer_length)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.output_text.find(stop, window_start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        return stop

    def get_text(self, finished: bool) -> str:
        """The text safe to show now: all of it once finished, else without the tail that
        could still turn out to be the start of a stop string."""
        if finished or self.include_stop_str_in_output or not self.stop_buffer_length:
            return self.output_text
        return self.output_text[: max(0, len(self.output_text) - self.stop_buffer_length)]
