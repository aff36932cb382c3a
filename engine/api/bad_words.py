"""`bad_words` as token-id sequences, as vLLM tokenizes them: each word alone and after a
space (a word mid-sentence is usually a different token than at the start of the text)."""

from __future__ import annotations

from typing import Any


def bad_words_token_ids(tokenizer: Any, bad_words: list[str]) -> list[list[int]]:
    sequences: list[list[int]] = []
    for word in bad_words:
        stripped = word.lstrip()
        for text in (stripped, " " + stripped):
            ids = list(tokenizer(text, add_special_tokens=False).input_ids)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
