"""Converting a GGUF file once into a cached Hugging Face-style directory (safetensors, fp32),
through transformers. A cache entry is written to a temporary directory and renamed into place,
so a crash never leaves a half-written entry and two processes converting at once both end up
with one. Where entries live and how they are named: engine/api/model_files.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from engine.api.model_files import gguf_cache_path
from engine.loader.gguf_file import read_gguf

logger = logging.getLogger(__name__)


# llama.cpp architectures of families we serve from safetensors only: our GGUF conversion
# (transformers' GGUF loader) does not map their tensor names, so they are refused up front,
# naming the file, rather than failing inside the conversion.
REFUSED_GGUF_ARCHITECTURES = {
    "deepseek2": (
        "DeepseekV3ForCausalLM (DeepSeek-V2/V3, Kimi K2): llama.cpp's tensor names for it are "
        "not mapped; serve the model's safetensors directory instead"
    ),
    "gpt-oss": (
        "GptOssForCausalLM: its expert tensors (ffn_*_exps, MXFP4 blocks) do not convert to "
        "the stacked experts; use the Hugging Face safetensors checkpoint (MXFP4 experts are "
        "dequantized at load)"
    ),
}


def check_gguf_architecture(gguf_path: Path) -> None:
    """NotImplementedError naming the file for a GGUF architecture we refuse (a header
    that does not parse is left to the conversion, which reports it)."""
    try:
        architecture = read_gguf(gguf_path).architecture
    except ValueError:
        return
    reason = REFUSED_GGUF_ARCHITECTURES.get(architecture)
    if reason is not None:
        raise NotImplementedError(
            f"{gguf_path}: GGUF architecture {architecture!r} cannot be loaded from GGUF: {reason}."
        )


def cached_gguf_conversion(gguf_path: Path, cache_dir: Path | None) -> Path:
    target = gguf_cache_path(gguf_path, cache_dir)
    if (target / "config.json").is_file():
        return target
    check_gguf_architecture(gguf_path)
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
