"""Fixtures shared by the engine tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

# The tiny GGUF files keep the default model's first tokens only: every GGUF reader
# (gguf-py's, transformers') parses each string of the vocabulary and merge list, ~11 s
# per read of the whole 49,152-token tokenizer on a 2-core machine, read four times per
# file. 512 tokens hold the byte alphabet, the special tokens and the first merges.
SMALL_VOCABULARY = 512


@dataclass(frozen=True)
class TokenizerField:
    """One `tokenizer.*` key of a GGUF file, in the shape GGUFWriter.add_key_value takes
    (the attributes of gguf-py's ReaderField the test writers use)."""

    name: str
    value: Any
    types: list[Any]

    def contents(self) -> Any:
        return self.value


def small_tokenizer_fields(fields: list[Any], size: int) -> list[TokenizerField]:
    """The tokenizer of `fields` cut to its first `size` tokens: their types, and the
    merges whose parts and result are all kept (a consistent byte-level BPE); special
    token ids must lie below `size`."""
    by_name = {field.name: field for field in fields}
    tokens = by_name["tokenizer.ggml.tokens"].contents()[:size]
    kept = set(tokens)
    merges = [
        merge
        for merge in by_name["tokenizer.ggml.merges"].contents()
        if (parts := merge.split(" ", 1))[0] in kept and parts[1] in kept and "".join(parts) in kept
    ]
    cut = {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": by_name["tokenizer.ggml.token_type"].contents()[:size],
        "tokenizer.ggml.merges": merges,
    }
    small = []
    for field in fields:
        value = cut.get(field.name, field.contents())
        if field.name.endswith("_token_id") and not 0 <= value < size:
            raise ValueError(f"{field.name} = {value} lies outside the first {size} tokens")
        small.append(TokenizerField(field.name, value, list(field.types)))
    return small


@pytest.fixture(scope="session")
def tokenizer_fields():
    """The default model's tokenizer metadata (transformers needs one in a GGUF file), cut
    to `SMALL_VOCABULARY` tokens; the files' embedding has as many rows
    (tests/engine/gguf_files.py: `vocabulary_size`)."""
    from gguf import GGUFReader

    from engine.api.model_files import default_model_path

    reader = GGUFReader(default_model_path())
    fields = [field for name, field in reader.fields.items() if name.startswith("tokenizer.")]
    return small_tokenizer_fields(fields, SMALL_VOCABULARY)
