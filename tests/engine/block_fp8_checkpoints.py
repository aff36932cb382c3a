"""Block-scaled FP8 checkpoints of tiny random models, in the Hub's layouts, made in the tests.

- `quantize_blocks(weight, block)`: the format's definition, written here from it (not from
  the engine's loader): one scale per [rows, cols] block, ragged at the edges, scale =
  the block's absolute maximum / 448 (transformers' and DeepSeek's quantizers), weight =
  weight / scale rounded to E4M3.
- `dequantize_blocks_float64(q, scale, block)`: the real weight it stands for, in float64,
  by repeating each scale over its block's rows and columns.
- `make_block_fp8(source, path, reference, block)`: transformers' `quant_method: "fp8"`
  layout (Qwen3-*-FP8, DeepSeek-V3): every Linear weight of the float checkpoint `source`
  but the LM head, the embeddings and DeepSeek's router (not `nn.Linear` in transformers)
  and `not_converted` as `weight` float8_e4m3fn + `weight_scale_inv` float32; config.json
  gets the `quantization_config` as those releases write it. `reference` gets the same model
  with the dequantized weights as a plain checkpoint, for transformers (whose own FP8
  dequantization derives the block from the scale grid's shape, which is wrong for ragged
  edge blocks: 160 rows in blocks of 128 would be read as two blocks of 80).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

FP8_MAX = 448.0


def quantize_blocks(
    weight: torch.Tensor,  # [N, K] float
    block: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:  # fp8 [N, K], fp32 [ceil(N/rows), ceil(K/cols)]
    rows, cols = block
    n, k = weight.shape
    scale = torch.empty(math.ceil(n / rows), math.ceil(k / cols))
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].float()
            s = max(float(tile.abs().max()) / FP8_MAX, 1e-12)
            scale[i, j] = s
            q[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols] = (
                (tile / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            )
    return q, scale


def dequantize_blocks_float64(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:  # [N, K] float64
    n, k = q.shape
    spread = scale.double().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)
    return q.double() * spread[:, :k]


def _quantized(name: str, tensor: torch.Tensor, not_converted: tuple[str, ...]) -> bool:
    module = name.removesuffix(".weight")
    return (
        name.endswith(".weight")
        and tensor.dim() == 2
        and not name.endswith(("embed_tokens.weight", "lm_head.weight", ".mlp.gate.weight"))
        and module not in not_converted
    )


def make_block_fp8(
    source: Path,
    path: Path,
    reference: Path,
    block: tuple[int, int] = (128, 128),
    not_converted: tuple[str, ...] = (),
) -> tuple[Path, Path]:
    from safetensors.torch import load_file, save_file

    tensors = load_file(source / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if _quantized(name, tensor, not_converted):
            q, scale = quantize_blocks(tensor, block)
            quantized[name] = q
            quantized[f"{name.removesuffix('.weight')}.weight_scale_inv"] = scale
            dequantized[name] = dequantize_blocks_float64(q, scale, block).float()
        else:
            quantized[name] = dequantized[name] = tensor
    for directory, out in ((path, quantized), (reference, dequantized)):
        directory.mkdir(parents=True, exist_ok=True)
        for file in source.iterdir():
            if file.name != "model.safetensors":
                shutil.copy(file, directory / file.name)
        save_file(out, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        **({"modules_to_not_convert": list(not_converted)} if not_converted else {}),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path, reference
