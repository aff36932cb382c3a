"""The quantized tensors of a GGUF file as `QuantizedWeight`s in our layout.

gguf-py's reader gives each tensor's raw block bytes as [rows, row_bytes] with rows the
output dimension (GGUF lists dims innermost first, so a [out, in] matrix is stored with
shape (in, out) and blocks running along `in`). Two things differ from the Hugging Face
layout the model uses:

- For the `llama` architecture (Llama, Mistral) llama.cpp's converter permutes the rows of
  q and k (rotary pairs interleaved per head: within a head, HF row j * (D/2) + i is GGUF
  row 2i + j). Since blocks run along the input dimension, undoing it is a row permutation
  of the blocks (`_unpermute_index`). The other families' files keep HF's row order.
- Names: `blk.{i}.attn_q` is `model.layers.{i}.self_attn.q_proj` and so on; Phi-3's file
  stores the fused `attn_qkv` and a fused gate|up as `ffn_up`, which are our fused modules.
- Only tensors stored in a block type we run (`QType`) are returned; F32/F16 tensors
  (norms, sometimes small projections) stay with the fp32 model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.native.quant import QType, QuantizedWeight

# Architectures whose GGUF tensor names and q/k permutation this module knows.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
_PERMUTED_QK = ("llama",)
_QTYPES = {int(t) for t in QType if t != QType.INT8}


def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("general.architecture")
    return str(field.contents()) if field is not None else ""


def _unpermute_index(rows: int, num_heads: int) -> torch.Tensor:
    """index such that hf_rows = gguf_rows[index] for a q/k weight of `num_heads` heads."""
    half = rows // num_heads // 2
    # gguf row of (head h, pair i, member j) is h*D + 2i + j; HF orders (h, j, i).
    return torch.arange(rows).reshape(num_heads, half, 2).permute(0, 2, 1).reshape(-1)


def _to_quantized(tensor: Any) -> QuantizedWeight:
    data = torch.from_numpy(np.ascontiguousarray(tensor.data).view(np.uint8).copy())
    in_features = int(tensor.shape[0])  # GGUF dims are innermost first
    return QuantizedWeight(data, QType(int(tensor.tensor_type)), in_features)


def read_gguf_blocks(path: Path, hf_config: Any) -> dict[str, QuantizedWeight]:
    """Hugging Face weight name -> its quantized weight, for every block-quantized 2-D
    tensor of a GGUF file of a supported architecture (llama's q/k rows un-permuted)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    field = reader.fields.get("general.architecture")
    architecture = str(field.contents()) if field is not None else ""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {architecture!r} is not one of {SUPPORTED_ARCHITECTURES}."
        )
    permuted = architecture in _PERMUTED_QK
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(architecture, {})}
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    out: dict[str, QuantizedWeight] = {}
    for tensor in reader.tensors:
        if int(tensor.tensor_type) not in _QTYPES or len(tensor.shape) != 2:
            continue
        name = _hf_name(tensor.name, names)
        if name is None:
            continue
        weight = _to_quantized(tensor)
        if permuted and name.endswith("self_attn.q_proj.weight"):
            weight = weight.take_rows(_unpermute_index(weight.out_features, num_heads))
        elif permuted and name.endswith("self_attn.k_proj.weight"):
            weight = weight.take_rows(_unpermute_index(weight.out_features, num_kv_heads))
        out[name] = weight
    return out


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
