"""The files the tokenizer service needs from a model: tokenizer, chat template and
generation config. It never loads weights.

A Hugging Face directory is read as is. A GGUF file (the default model is one) is read
from the engine's converted cache entry when there is one; otherwise the tokenizer is read
from the GGUF file itself, without generation-config defaults (converting would mean
loading the weights, which is the engine's job).

The tokenizer is the light one (services/tokenizer_service/light_tokenizer.py: the
`tokenizers` library and jinja2, no transformers) where the files allow, else transformers'
`AutoTokenizer`, with the reason logged once. `PAGEDSERVE_TOKENIZER_BACKEND=transformers`
asks for transformers' in any case (the same ids and text, the old start-up cost). The
generation config is read as JSON either way.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.api.model_files import (
    default_model_path,
    find_model,
    gguf_cache_path,
    load_tokenizer,
)
from services.tokenizer_service.light_tokenizer import LightUnsupported, load_light_tokenizer

logger = logging.getLogger("services.tokenizer_service.model_files")

BACKEND_ENV = "PAGEDSERVE_TOKENIZER_BACKEND"  # "transformers": never the light tokenizer


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
    return TextModelFiles(
        load_model_tokenizer(model_dir), read_generation_config(model_dir), str(model_dir)
    )


def load_model_tokenizer(model_dir: Path) -> Any:
    """The light tokenizer where `model_dir`'s files allow, else transformers'."""
    if os.environ.get(BACKEND_ENV, "").lower() == "transformers":
        reason = f"{BACKEND_ENV}=transformers"
    else:
        try:
            tokenizer: Any = load_light_tokenizer(model_dir)
        except LightUnsupported as exc:
            reason = str(exc)
        else:
            logger.info("tokenizer: tokenizers + jinja2", extra={"path": str(model_dir)})
            return tokenizer
    logger.info("tokenizer: transformers (%s)", reason, extra={"path": str(model_dir)})
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise FileNotFoundError(f"no tokenizer files in {model_dir}")
    return tokenizer


def read_generation_config(model_dir: Path) -> dict[str, Any]:
    """generation_config.json's values that are set, as transformers' (v5)
    `GenerationConfig.to_diff_dict()` returns them for what the service reads (every field it
    reads defaults to None there): without importing transformers."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return {key: value for key, value in data.items() if value is not None}


def _from_gguf(path: Path) -> TextModelFiles:
    from transformers import AutoTokenizer

    logger.info(
        "tokenizer: transformers (a GGUF file the engine has not converted yet)",
        extra={"path": str(path)},
    )
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return TextModelFiles(tokenizer, {}, str(path))
