"""Test helpers shared by model-level and engine-level tests.

- `make_tiny_llama(path, ...)`: a random-weight transformers Llama saved as a Hugging Face
  directory (config.json + model.safetensors [+ tokenizer]); nothing is downloaded.
- `build_attn_metadata(requests, ...)` / `build_positions(requests, ...)`: the per-step
  inputs of one batch given each request's (num_computed, query_len, block_table).
- `allocate_block_tables(...)`: non-contiguous (shuffled) block tables for a few requests.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine.attention.backend import AttentionMetadata

DEFAULT_VOCAB_SIZE = 128
TOKENIZER_VOCAB_SIZE = 49152  # the default model's tokenizer (SmolLM2)


def make_tiny_llama(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    seed: int = 0,
    with_tokenizer: bool = False,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    attention_bias: bool = False,
    mlp_bias: bool = False,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Saves a random-weight `transformers.LlamaForCausalLM` (fp32 safetensors) to `path`.

    Weights use initializer_range 0.15 so logits are peaky (greedy choices are not near-ties);
    norm weights and biases are randomized too, so a loader that drops them is caught.
    `vocab_size` defaults to 128, or 49152 with `with_tokenizer=True`, which copies the
    tokenizer files of `tokenizer_dir` (default: the converted default model, converted into
    the user cache on first use) and requires that vocabulary size. `rope_scaling` is a
    Hugging Face rope dict (without rope_theta), e.g. {"rope_type": "llama3", "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}.
    bos/eos are ids 1/2, as in SmolLM2. Returns `path` as a Path.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if vocab_size is None:
        vocab_size = TOKENIZER_VOCAB_SIZE if with_tokenizer else DEFAULT_VOCAB_SIZE
    if with_tokenizer and vocab_size != TOKENIZER_VOCAB_SIZE:
        raise ValueError(f"with_tokenizer=True needs vocab_size={TOKENIZER_VOCAB_SIZE}.")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        initializer_range=0.15,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta},
        attention_bias=attention_bias,
        mlp_bias=mlp_bias,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    model.save_pretrained(path)
    if with_tokenizer:
        _copy_tokenizer(Path(tokenizer_dir) if tokenizer_dir else None, path)
    return path


# Text-only architectures whose config class is not <Name>Config.
_CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}


def make_tiny_model(
    path: str | Path,
    architecture: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_position_embeddings: int = 256,
    seed: int = 0,
    **config_kwargs: Any,
) -> Path:
    """Saves a random-weight transformers model of `architecture` (e.g. "Qwen2ForCausalLM"),
    built from transformers' own config class, as fp32 safetensors in `path`.

    Same conventions as `make_tiny_llama` (peaky logits, randomized norms and biases, bos/eos
    1/2); `config_kwargs` go to the config class (head_dim, tie_word_embeddings, ...).
    `LlamaForCausalLM` goes through `make_tiny_llama`.
    """
    import transformers

    if architecture == "LlamaForCausalLM":
        return make_tiny_llama(
            path,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            vocab_size=vocab_size,
            max_position_embeddings=max_position_embeddings,
            seed=seed,
            **config_kwargs,
        )
    path = Path(path)
    config_name = _CONFIG_CLASSES.get(architecture, architecture.replace("ForCausalLM", "Config"))
    config_class = getattr(transformers, config_name)
    model_class = getattr(transformers, architecture)
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=config_kwargs.pop("intermediate_size", 2 * hidden_size),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **config_kwargs,
    )
    _save_random(model_class(config), path, seed)
    return path


def _save_random(model: Any, path: Path, seed: int) -> None:
    """Re-draws `model`'s weights from `seed` (norms near 1, small random biases) and saves it."""
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    model.eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.15)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    model.save_pretrained(path)


def _copy_tokenizer(source: Path | None, dest: Path) -> None:
    if source is None:
        from engine.loader.model_dir import resolve_model

        source = resolve_model(None)
    for file in source.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_")):
            shutil.copy2(file, dest / file.name)


def allocate_block_tables(
    num_tokens_per_req: Sequence[int], block_size: int, num_blocks: int, seed: int = 0
) -> list[list[int]]:
    """Gives each request enough blocks for its tokens, drawn from a shuffled pool."""
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    tables = []
    for num_tokens in num_tokens_per_req:
        count = -(-num_tokens // block_size)
        if count > len(pool):
            raise ValueError("not enough blocks")
        tables.append([pool.pop() for _ in range(count)])
    return tables


def build_attn_metadata(
    requests: Sequence[tuple[int, int, Sequence[int]]],
    *,
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for one step; `requests` are (num_computed, query_len, block_table) in batch
    order (decodes, i.e. query_len == 1, first)."""
    query_lens = [query_len for _, query_len, _ in requests]
    num_decodes = sum(1 for q in query_lens if q == 1)
    if any(q != 1 for q in query_lens[:num_decodes]):
        raise ValueError("decode requests (query_len == 1) must come first")
    if any(q < 1 for q in query_lens):
        raise ValueError("every request needs at least one query token")
    query_start_loc = [0]
    for query_len in query_lens:
        query_start_loc.append(query_start_loc[-1] + query_len)
    seq_lens = [num_computed + query_len for num_computed, query_len, _ in requests]
    slot_mapping = []
    for num_computed, query_len, table in requests:
        if len(table) * block_size < num_computed + query_len:
            raise ValueError("block table too short for the request's tokens")
        for pos in range(num_computed, num_computed + query_len):
            slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
    max_blocks = max((len(table) for _, _, table in requests), default=1)
    block_tables = [list(table) + [0] * (max_blocks - len(table)) for _, _, table in requests]
    return AttentionMetadata(
        num_actual_tokens=query_start_loc[-1],
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(block_tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )


def build_positions(
    requests: Sequence[tuple[int, int, Sequence[int]]],
    *,
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # [num_tokens] int64
    """Absolute positions of each query token."""
    positions = []
    for num_computed, query_len, _ in requests:
        positions.extend(range(num_computed, num_computed + query_len))
    return torch.tensor(positions, dtype=torch.int64, device=device)
