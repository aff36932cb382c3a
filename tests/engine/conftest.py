"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tokenizer_fields():
    """The default model's tokenizer metadata (transformers needs one in a GGUF file)."""
    from gguf import GGUFReader

    from engine.api.model_files import default_model_path

    reader = GGUFReader(default_model_path())
    return [field for name, field in reader.fields.items() if name.startswith("tokenizer.")]
