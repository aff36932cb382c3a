"""Incremental detokenization in Rust: the `tokenizers` library's `DecodeStream` in place of
two Python `decode` calls per token.

`IncrementalDetokenizer` (engine/api/detokenizer.py) decodes a sliding window of token ids
twice per token through the tokenizer's Python wrapper. `DecodeStream.step` runs the same
algorithm in Rust (prefix and read offsets, text held back while it ends in U+FFFD), one call
per token, so the text is the same: tests/engine/api/test_stream_detokenizer.py checks it
against the Python one over random token ids of several tokenizers, deltas and final text.

Two differences are bridged here. Where the window's new text does not start with its old
text (a decoder that rewrites earlier characters, e.g. byte-fallback pieces that only form a
character together), Rust raises where Python slices by length; and a stream primed with
ids whose text ends in U+FFFD (half a character of the prompt) starts from an empty prefix.
In both cases tokens are decoded the Python way from the offsets mirrored here, and Rust
takes over again, with a fresh stream primed with the window, at the next token that emits
text.

Stop strings, the held-back tail and `get_text` are the base class's (only the new text plus
the longest stop string's length is searched). `spaces_between_special_tokens` changes
neither path: a Rust-backed tokenizer's `decode` has no such option (transformers applies it
only to its slow Python tokenizers, which have no Rust backend and keep the Python path).
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from engine.api.detokenizer import _REPLACEMENT_CHAR, IncrementalDetokenizer


def backend_of(tokenizer: Any) -> Tokenizer | None:
    """The Rust tokenizer behind `tokenizer` (transformers' fast tokenizers and the tokenizer
    service's light one both hold it), or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


class StreamDetokenizer(IncrementalDetokenizer):
    """`IncrementalDetokenizer` whose per-token decoding is `DecodeStream.step`."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], **kwargs: Any) -> None:
        super().__init__(tokenizer, prompt_token_ids, **kwargs)
        backend = backend_of(tokenizer)
        if backend is None:
            raise TypeError("StreamDetokenizer needs a tokenizer backed by tokenizers.Tokenizer")
        self.backend = backend
        self._stream: DecodeStream | None = self._new_stream()

    def _new_stream(self) -> DecodeStream | None:
        """A stream primed with the window: its text is the prefix, its read offset the end.
        None (Python steps) while the window's text ends in U+FFFD: a primed stream then
        takes an empty prefix, where Python compares with that text."""
        window = self.token_ids[self.prefix_offset :]
        if window and self._decode(window).endswith(_REPLACEMENT_CHAR):
            return None
        return DecodeStream(window, skip_special_tokens=self.skip_special_tokens)

    def _append(self, new_token_ids: list[int]) -> None:
        backend = self.backend
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            stream = self._stream
            if stream is not None:
                try:
                    text = stream.step(backend, token_id)
                except Exception:  # the new text does not extend the old: Python's rule below
                    self._stream = None
                else:
                    if text is not None:
                        self.output_text += text
                        self.prefix_offset = self.read_offset
                        self.read_offset = len(self.token_ids)
                    continue
            self._python_step()

    def _python_step(self) -> None:
        """The base class's step for the last token; a fresh Rust stream once it emits (the
        window then ends at the read offset, which is how a stream is primed)."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
            self.output_text += new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self._stream = self._new_stream()


def make_detokenizer(
    tokenizer: Any, prompt_token_ids: list[int], **kwargs: Any
) -> IncrementalDetokenizer:
    """A `StreamDetokenizer` where the tokenizer has a Rust backend whose `decode` is the one
    the Python detokenizer calls, else the Python `IncrementalDetokenizer`."""
    if backend_of(tokenizer) is not None and _decodes_with_backend(tokenizer):
        return StreamDetokenizer(tokenizer, prompt_token_ids, **kwargs)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, **kwargs)


def _decodes_with_backend(tokenizer: Any) -> bool:
    """transformers' fast tokenizers and those that say so (`decodes_with_backend`, the
    tokenizer service's light one) decode with their backend (the clean-up the Python
    detokenizer turns off is all they add); a subclass that overrides `decode` or `_decode`
    may do more, so it keeps the Python path."""
    cls = type(tokenizer)
    if getattr(cls, "decodes_with_backend", False):
        return True
    for klass in cls.__mro__:
        if klass.__name__ == "TokenizersBackend":
            return True
        if "decode" in klass.__dict__ or "_decode" in klass.__dict__:
            return False
    return False
