"""The files the tokenizer service needs from a model: tokenizer, chat template and
generation config. It never loads weights.

A Hugging Face directory is read as is. A GGUF file (the default model is one) is read
from the engine's converted cache entry when there is one; otherwise the tokenizer is read
from the GGUF file itself, without generation-config defaults (converting would mean
loading the weights, which is the engine's job).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.api.model_files import (
    default_model_path,
    find_model,
    gguf_cache_path,
    load_generation_config,
    load_tokenizer,
)

logger = logging.getLogger("services.tokenizer_service.model_files")


@dataclass
class TextModelFiles:
    tokenizer: Any
    generation_config: dict[str, Any] = field(default_factory=dict)
    source: str = ""


def needs_torch(model: str | None) -> bool:
    """Whether reading `model`'s text files needs torch: only a GGUF file the engine has not
    converted yet, whose tokenizer transformers reads through its GGUF integration (which
    imports torch). A directory or a converted cache entry is read without it."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return not (gguf_cache_path(path) / "config.json").is_file()
    return False


def load_text_model_files(model: str | None) -> TextModelFiles:
    """The tokenizer and generation config of `model` (a directory, a .gguf file, or None
    for the default model)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        cached = gguf_cache_path(path)
        if not (cached / "config.json").is_file():
            return _from_gguf(path)
        path = cached
    model_dir = find_model(path)  # a GGUF file went above: nothing left to convert
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise FileNotFoundError(f"no tokenizer files in {model_dir}")
    generation = load_generation_config(model_dir)
    return TextModelFiles(
        tokenizer, generation.to_diff_dict() if generation is not None else {}, str(model_dir)
    )


def _from_gguf(path: Path) -> TextModelFiles:
    from transformers import AutoTokenizer

    logger.info("reading the tokenizer from the GGUF file", extra={"path": str(path)})
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return TextModelFiles(tokenizer, {}, str(path))
