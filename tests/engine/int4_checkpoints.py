"""Tiny AWQ and GPTQ checkpoints made from random Llama models, in the Hub's layout.

Written from the formats' definitions, independently of the engine's decoder
(engine/loader/int4_packing.py), so the tests check one reading against another:

    GPTQ  qweight int32 [K/8, N]  nibble i of [r, n] = q[8r + i, n]          (along the input)
          qzeros  int32 [G, N/8]  nibble i of [g, c] = z[g, 8c + i] - 1      (v1; v2: z)
          scales  fp16 [G, N]; g_idx int32 [K] (act-order: a permutation's groups)
    AWQ   qweight int32 [K, N/8]  nibble i of [k, c] = q[k, 8c + ORDER[i]], ORDER = 0,2,4,6,1,3,5,7
          qzeros  int32 [G, N/8]  the same interleaving; scales fp16 [G, N]

`write_int4_checkpoint` quantizes every decoder projection of a saved model (round to
nearest per group) and writes two directories: the INT4 checkpoint (config.json with the
format's `quantization_config`, the other tensors in fp16 as the Hub ships them) and the
reference (plain safetensors of exactly the dequantized weights, for transformers).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

AWQ_NIBBLE_COLUMNS = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column 8c + this
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values (int64) -> the int32 with those bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along_rows(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R/8, C], nibble i of [r, c] = codes[8r + i, c]."""
    words = torch.zeros(codes.shape[0] // 8, codes.shape[1], dtype=torch.int64)
    for i in range(8):
        words |= codes[i::8].to(torch.int64) << (4 * i)
    return _as_int32(words)


def pack_along_columns(codes: torch.Tensor, columns: tuple[int, ...]) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R, C/8], nibble i of [r, c] = codes[r, 8c + columns[i]]."""
    words = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for i, column in enumerate(columns):
        words |= codes[:, column::8].to(torch.int64) << (4 * i)
    return _as_int32(words)


def quantize(weight: torch.Tensor, g_idx: torch.Tensor, num_groups: int, sym: bool):
    """Round-to-nearest INT4 of `weight` [N, K] with input channel k in group g_idx[k]:
    (codes [K, N], fp16 scales [G, N], zero points [G, N]) and the dequantized [N, K] fp32."""
    w = weight.T.float()  # [K, N]
    scales = torch.empty(num_groups, w.shape[1])
    zeros = torch.empty(num_groups, w.shape[1], dtype=torch.int64)
    for g in range(num_groups):
        rows = w[g_idx == g]
        if sym:
            scales[g] = rows.abs().amax(0).clamp(min=1e-4) / 7
            zeros[g] = 8
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scales[g] = ((hi - lo) / 15).clamp(min=1e-4)
            zeros[g] = (-lo / scales[g]).round().clamp(0, 15).to(torch.int64)
    scales = scales.to(torch.float16)
    s, z = scales.float()[g_idx], zeros[g_idx]  # [K, N] per row's group
    codes = (w / s).round().to(torch.int64).add(z).clamp(0, 15)
    dequantized = ((codes - z).float() * s).T.contiguous()  # [N, K]
    return codes, scales, zeros, dequantized


def quantization_config(method: str, group_size: int, sym: bool, desc_act: bool) -> dict:
    if method == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "damp_percent": 0.01,
        "true_sequential": True,
        "static_groups": False,
        "checkpoint_format": "gptq_v2" if method == "gptq_v2" else "gptq",
    }


def write_int4_checkpoint(
    model_dir: Path,
    out_dir: Path,
    method: str,  # "awq", "gptq" (v1 zero points) or "gptq_v2"
    group_size: int = 128,
    sym: bool = False,
    desc_act: bool = False,
    seed: int = 0,
) -> tuple[Path, Path]:
    """(INT4 checkpoint dir, reference dir) made from the fp32 model in `model_dir`."""
    quant_dir, ref_dir = out_dir / f"{method}-int4", out_dir / f"{method}-reference"
    quant_dir.mkdir(parents=True)
    ref_dir.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rpartition(".")[2] not in PROJECTIONS:
            quantized[name] = tensor.to(torch.float16)
            reference[name] = quantized[name].float()
            continue
        k = tensor.shape[1]
        size = k if group_size == -1 else group_size
        groups = k // size
        g_idx = torch.arange(k) // size
        if desc_act:
            g_idx = g_idx[torch.randperm(k, generator=gen)]
        codes, scales, zeros, dequantized = quantize(tensor, g_idx, groups, sym)
        reference[name] = dequantized
        if method == "awq":
            quantized[f"{module}.qweight"] = pack_along_columns(codes, AWQ_NIBBLE_COLUMNS)
            quantized[f"{module}.qzeros"] = pack_along_columns(zeros, AWQ_NIBBLE_COLUMNS)
        else:
            stored = zeros - 1 if method == "gptq" else zeros  # v1 keeps z - 1, in 4 bits
            quantized[f"{module}.qweight"] = pack_along_rows(codes)
            quantized[f"{module}.qzeros"] = pack_along_columns(stored & 0xF, tuple(range(8)))
            quantized[f"{module}.g_idx"] = g_idx.to(torch.int32)
        quantized[f"{module}.scales"] = scales
    save_file(quantized, quant_dir / "model.safetensors")
    save_file(reference, ref_dir / "model.safetensors")
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    (ref_dir / "config.json").write_text(json.dumps(config))
    fmt = "gptq" if method.startswith("gptq") else "awq"
    config["quantization_config"] = quantization_config(method, group_size, sym, desc_act)
    config["quantization_config"]["quant_method"] = fmt
    config["torch_dtype"] = "float16"
    (quant_dir / "config.json").write_text(json.dumps(config))
    for extra in model_dir.iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            shutil.copy2(extra, quant_dir / extra.name)
            shutil.copy2(extra, ref_dir / extra.name)
    return quant_dir, ref_dir
