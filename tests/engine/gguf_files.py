"""Tiny llama GGUF files written with gguf-py for the quantized-weights tests.

Block bytes are random (with finite fp16 scales), not quantized from fp32 weights: gguf-py
cannot quantize to k-quants, and any bytes are a valid model. Transformers dequantizes the
file on its own (undoing llama.cpp's q/k permutation), which makes it an independent
reference for our loader's name mapping and row un-permutation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from engine.native.quant import BLOCK_SIZES, QType

HIDDEN = 256  # a multiple of the k-quants' 256-value super-block
INTERMEDIATE = 512
NUM_HEADS = 4
NUM_KV_HEADS = 2


def vocabulary_size(tokenizer_fields: list[Any]) -> int:
    """The rows of the embedding: one per token of the copied tokenizer."""
    (tokens,) = (f for f in tokenizer_fields if f.name == "tokenizer.ggml.tokens")
    return len(tokens.contents())


# Offsets of the fp16 scale fields inside one block.
_SCALE_OFFSETS = {
    QType.Q8_0: (0,),
    QType.Q4_0: (0,),
    QType.Q4_1: (0, 2),
    QType.Q4_K: (0, 2),
    QType.Q6_K: (208,),
}


def random_blocks(
    qtype: QType, rows: int, cols: int, seed: int, scale: float = 0.02
) -> np.ndarray:  # [rows, row_bytes] uint8
    """Random block bytes whose fp16 scales are N(0, scale) (finite by construction)."""
    rng = np.random.default_rng(seed)
    values, nbytes = BLOCK_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[qtype]:
        fp16 = (rng.standard_normal((rows, cols // values)) * scale).astype(np.float16)
        blocks[:, :, offset : offset + 2] = fp16.view(np.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


# Each layer's projections by GGUF name; together every block type, and q|k|v and
# gate|up fused across types (as in llama.cpp's Q4_K_M files).
LAYER_TYPES = (
    {
        "attn_q": QType.Q4_0,
        "attn_k": QType.Q4_0,
        "attn_v": QType.Q8_0,
        "attn_output": QType.Q4_1,
        "ffn_gate": QType.Q4_K,
        "ffn_up": QType.Q4_K,
        "ffn_down": QType.Q6_K,
    },
    {
        "attn_q": QType.Q4_K,
        "attn_k": QType.Q4_K,
        "attn_v": QType.Q6_K,
        "attn_output": QType.Q8_0,
        "ffn_gate": QType.Q4_1,
        "ffn_up": QType.Q4_0,
        "ffn_down": QType.Q4_1,
    },
)
EMBEDDING_TYPE = QType.Q8_0  # tied LM head, as in the default model


def write_tiny_llama_gguf(
    path: Path, tokenizer_fields: list[Any], scales: dict[QType, float]
) -> Path:
    """A 2-layer llama with the projections in `LAYER_TYPES`, the embedding (tied LM head)
    in `EMBEDDING_TYPE` and the norms in F32; `scales` sets each type's block scales."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-test-llama")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(len(LAYER_TYPES))
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // NUM_HEADS)
    for field in tokenizer_fields:
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    seed = iter(range(10_000))

    def add_blocks(name: str, qtype: QType, rows: int, cols: int) -> None:
        data = random_blocks(qtype, rows, cols, next(seed), scales[qtype])
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(int(qtype)))

    def add_norm(name: str) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    rng = np.random.default_rng(1)
    add_blocks("token_embd.weight", EMBEDDING_TYPE, vocabulary_size(tokenizer_fields), HIDDEN)
    add_norm("output_norm.weight")
    kv_rows = NUM_KV_HEADS * (HIDDEN // NUM_HEADS)
    for i, types in enumerate(LAYER_TYPES):
        add_norm(f"blk.{i}.attn_norm.weight")
        add_norm(f"blk.{i}.ffn_norm.weight")
        add_blocks(f"blk.{i}.attn_q.weight", types["attn_q"], HIDDEN, HIDDEN)
        add_blocks(f"blk.{i}.attn_k.weight", types["attn_k"], kv_rows, HIDDEN)
        add_blocks(f"blk.{i}.attn_v.weight", types["attn_v"], kv_rows, HIDDEN)
        add_blocks(f"blk.{i}.attn_output.weight", types["attn_output"], HIDDEN, HIDDEN)
        add_blocks(f"blk.{i}.ffn_gate.weight", types["ffn_gate"], INTERMEDIATE, HIDDEN)
        add_blocks(f"blk.{i}.ffn_up.weight", types["ffn_up"], INTERMEDIATE, HIDDEN)
        add_blocks(f"blk.{i}.ffn_down.weight", types["ffn_down"], HIDDEN, INTERMEDIATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# (num_heads, num_kv_heads) per family. transformers' GGUF reader does not map qwen3's
# `attention.key_length`, so a qwen3 file must have Qwen3's default head_dim of 128.
FAMILY_HEADS = {"qwen2": (4, 2), "qwen3": (2, 1), "gemma2": (4, 2), "phi3": (4, 2)}


def _family_extras(architecture: str, head_dim: int, kv_rows: int) -> list[tuple[str, int]]:
    """Per-family F32 tensors of a layer beyond llama's: (name, size)."""
    return {
        "qwen2": [("attn_q.bias", HIDDEN), ("attn_k.bias", kv_rows), ("attn_v.bias", kv_rows)],
        "qwen3": [("attn_q_norm.weight", head_dim), ("attn_k_norm.weight", head_dim)],
        "gemma2": [("post_attention_norm.weight", HIDDEN), ("post_ffw_norm.weight", HIDDEN)],
        "phi3": [],
    }[architecture]


def write_tiny_family_gguf(
    path: Path, architecture: str, tokenizer_fields: list[Any], qtype: QType = QType.Q8_0
) -> Path:
    """A 2-layer model of `architecture` (qwen2, qwen3, gemma2, phi3) with every projection
    in `qtype` blocks and the norms and biases in F32, named as llama.cpp names them."""
    import gguf

    num_heads, num_kv_heads = FAMILY_HEADS[architecture]
    head_dim = HIDDEN // num_heads
    q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny-test-{architecture}")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(2)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    if architecture == "gemma2":
        writer.add_sliding_window(6)
        writer.add_attn_logit_softcapping(5.0)
        writer.add_final_logit_softcapping(10.0)
    for field in tokenizer_fields:
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    seed = iter(range(10_000))
    rng = np.random.default_rng(1)

    def add_blocks(name: str, rows: int, cols: int) -> None:
        data = random_blocks(qtype, rows, cols, next(seed), 0.02)
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(int(qtype)))

    def add_f32(name: str, size: int, around: float) -> None:
        writer.add_tensor(name, (around + 0.1 * rng.standard_normal(size)).astype(np.float32))

    add_blocks("token_embd.weight", vocabulary_size(tokenizer_fields), HIDDEN)
    add_f32("output_norm.weight", HIDDEN, 1.0)
    for i in range(2):
        add_f32(f"blk.{i}.attn_norm.weight", HIDDEN, 1.0)
        add_f32(f"blk.{i}.ffn_norm.weight", HIDDEN, 1.0)
        for name, size in _family_extras(architecture, head_dim, kv_rows):
            add_f32(f"blk.{i}.{name}", size, 0.0 if name.endswith("bias") else 1.0)
        if architecture == "phi3":
            add_blocks(f"blk.{i}.attn_qkv.weight", q_rows + 2 * kv_rows, HIDDEN)
            add_blocks(f"blk.{i}.ffn_up.weight", 2 * INTERMEDIATE, HIDDEN)
        else:
            add_blocks(f"blk.{i}.attn_q.weight", q_rows, HIDDEN)
            add_blocks(f"blk.{i}.attn_k.weight", kv_rows, HIDDEN)
            add_blocks(f"blk.{i}.attn_v.weight", kv_rows, HIDDEN)
            add_blocks(f"blk.{i}.ffn_gate.weight", INTERMEDIATE, HIDDEN)
            add_blocks(f"blk.{i}.ffn_up.weight", INTERMEDIATE, HIDDEN)
        add_blocks(f"blk.{i}.attn_output.weight", HIDDEN, q_rows)
        add_blocks(f"blk.{i}.ffn_down.weight", HIDDEN, INTERMEDIATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
