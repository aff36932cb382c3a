"""The directory the engine loads a model from: the model the API names (`find_model`,
engine/api/model_files.py), with a GGUF file converted once into a cached directory. The
conversion loads the weights through torch, which is why this is the engine's side of model
resolution and the tokenizer service keeps to engine/api/model_files.py."""

from __future__ import annotations

import os
from pathlib import Path

from engine.api.model_files import find_model
from engine.loader.gguf_conversion import cached_gguf_conversion


def resolve_model(model: str | os.PathLike[str] | None, *, cache_dir: Path | None = None) -> Path:
    """Returns a Hugging Face-style model directory for `model`.

    `None` means the default model; a ``.gguf`` file is converted on first use and the cache
    entry returned; a directory is returned as is. `cache_dir` overrides the cache root.
    """
    path = find_model(model)
    if path.is_file():  # a .gguf file: find_model refuses any other
        return cached_gguf_conversion(path, cache_dir)
    return path
