"""The quantized tensors of a GGUF file as `QuantizedWeight`s in our layout.

A tensor's raw block bytes are [rows, row_bytes] with rows the output dimension (GGUF lists
dims innermost first, so a [out, in] matrix is stored with shape (in, out) and blocks
running along `in`). Two things differ from the Hugging Face
layout the model uses:

- For the `llama` architecture (Llama, Mistral) llama.cpp's converter permutes the rows of
  q and k (rotary pairs interleaved per head: within a head, HF row j * (D/2) + i is GGUF
  row 2i + j). Since blocks run along the input dimension, undoing it is a row permutation
  of the blocks (`_unpermute_index`). The other families' files keep HF's row order.
- Names: `blk.{i}.attn_q` is `model.layers.{i}.self_attn.q_proj` and so on; Phi-3's file
  stores the fused `attn_qkv` and a fused gate|up as `ffn_up`, which are our fused modules.
- Only tensors stored in a block type we run (`QType`) are described; F32/F16 tensors
  (norms, sometimes small projections) stay with the fp32 model.

The header is read by engine/loader/gguf_file.py (milliseconds, no tensor data); each
weight's bytes are then read once, straight into the matrix the kernels use (q|k|v and
gate|up of one block type stacked into one), by `read_blocks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.loader.gguf_file import GGUFFile, GGUFTensorInfo, read_gguf
from engine.native.quant import BLOCK_SIZES, QType, QuantizedWeight

# Architectures whose GGUF tensor names and q/k permutation this module knows.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
_PERMUTED_QK = ("llama",)
_QTYPES = {int(t) for t in QType if t != QType.INT8}


def gguf_architecture(path: Path) -> str:
    return read_gguf(path).architecture


@dataclass(frozen=True)
class GGUFBlockTensor:
    """A block-quantized 2-D tensor of the file, described in the model's layout."""

    info: GGUFTensorInfo  # info.shape is [out_features, in_features]
    qtype: QType
    row_index: torch.Tensor | None  # HF row r is file row row_index[r] (llama's q/k)

    @property
    def out_features(self) -> int:
        return self.info.shape[0]

    @property
    def in_features(self) -> int:
        return self.info.shape[1]

    @property
    def row_bytes(self) -> int:
        block_values, block_bytes = BLOCK_SIZES[self.qtype]
        return self.in_features // block_values * block_bytes


def _unpermute_index(rows: int, num_heads: int) -> torch.Tensor:
    """index such that hf_rows = gguf_rows[index] for a q/k weight of `num_heads` heads."""
    half = rows // num_heads // 2
    # gguf row of (head h, pair i, member j) is h*D + 2i + j; HF orders (h, j, i).
    return torch.arange(rows).reshape(num_heads, half, 2).permute(0, 2, 1).reshape(-1)


def gguf_block_tensors(gguf: GGUFFile, hf_config: Any) -> dict[str, GGUFBlockTensor]:
    """Hugging Face weight name -> its description, for every block-quantized 2-D tensor
    of a GGUF file of a supported architecture. Reads no tensor data."""
    architecture = gguf.architecture
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {architecture!r} is not one of {SUPPORTED_ARCHITECTURES}."
        )
    permuted = architecture in _PERMUTED_QK
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(architecture, {})}
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    out: dict[str, GGUFBlockTensor] = {}
    for info in gguf.tensors.values():
        if info.ggml_type not in _QTYPES or len(info.shape) != 2:
            continue
        name = _hf_name(info.name, names)
        if name is None:
            continue
        index = None
        if permuted and name.endswith("self_attn.q_proj.weight"):
            index = _unpermute_index(info.shape[0], num_heads)
        elif permuted and name.endswith("self_attn.k_proj.weight"):
            index = _unpermute_index(info.shape[0], num_kv_heads)
        out[name] = GGUFBlockTensor(info, QType(info.ggml_type), index)
    return out


def read_blocks(
    gguf: GGUFFile,
    tensors: list[GGUFBlockTensor],  # of one block type and width, stacked in this order
) -> QuantizedWeight:
    """The tensors' block rows read from the file into one new matrix (our row order)."""
    qtype, in_features = tensors[0].qtype, tensors[0].in_features
    if any(t.qtype != qtype or t.in_features != in_features for t in tensors):
        raise ValueError(f"cannot stack GGUF tensors {[t.info.name for t in tensors]}.")
    rows = sum(t.out_features for t in tensors)
    data = torch.empty(rows, tensors[0].row_bytes, dtype=torch.uint8)  # [rows, row_bytes]
    start = 0
    for tensor in tensors:
        target = data[start : start + tensor.out_features]
        if tensor.row_index is None:
            gguf.read_into(tensor.info.name, target.numpy())
        else:  # numpy's gather: one thread, where torch's forks a team for 100 KB
            stored = torch.empty_like(target)
            gguf.read_into(tensor.info.name, stored.numpy())
            target.numpy()[:] = stored.numpy()[tensor.row_index.numpy()]
        start += tensor.out_features
    return QuantizedWeight(data, qtype, in_features)


def read_gguf_blocks(path: Path, hf_config: Any) -> dict[str, QuantizedWeight]:
    """Every block-quantized 2-D tensor of the file, read, by Hugging Face name."""
    gguf = read_gguf(path)
    return {
        name: read_blocks(gguf, [tensor])
        for name, tensor in gguf_block_tensors(gguf, hf_config).items()
    }


_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where a family's file names differ: Phi-3 stores q|k|v and gate|up fused.
_ARCH_LAYER_NAMES = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}


def _hf_name(gguf_name: str, names: dict[str, str]) -> str | None:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight (None: not a matrix
    we keep quantized)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.weight"
    return None
