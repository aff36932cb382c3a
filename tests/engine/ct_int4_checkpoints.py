"""compressed-tensors `pack-quantized` INT4 checkpoints (llm-compressor's W4A16 and
W4A16_ASYM) of tiny random models, written by the `compressed-tensors` package itself.

- `compress_weight(weight, args)`: one projection through the package's own compressor
  (`PackedQuantizationCompressor.compress`), with min-max scales and zero points from its
  `calculate_qparams` (llm-compressor's default observer), and the package's own
  decompression of the result (`decompress`) as the reference.
- `write_ct_int4_checkpoint(model_dir, out_dir, ...)`: a whole model through the package's
  quantization lifecycle and `ModelCompressor` (the files and `quantization_config`
  llm-compressor saves), and the reference: the same model with the package's decompression
  of every projection (scales in fp32, so exact) as a plain checkpoint for transformers.

Act-order "group" (weights stored in column order with a `weight_g_idx` of each input
channel's group) is refused by the installed package version, which dropped it; such
checkpoints are still on the Hub. They are written here as the older package did: the
weight's columns permuted so that each group is contiguous, quantized by the package, then
its codes put back in column order (the package's pack/unpack helpers) beside `g_idx`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

CT_MISSING = "compressed-tensors needs Python >= 3.11 (the dev extra)"
PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")


def quantization_args(symmetric: bool = True, group_size: int = 128) -> Any:
    """4-bit int weight args: strategy "group" (group_size > 0) or "channel" (-1)."""
    from compressed_tensors.quantization import QuantizationArgs

    strategy = "channel" if group_size == -1 else "group"
    size = None if group_size == -1 else group_size
    return QuantizationArgs(
        num_bits=4, type="int", symmetric=symmetric, strategy=strategy, group_size=size
    )


def _qparams(weight: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max scale and zero point [N, G] of `weight` [N, K] (columns in group order)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    n, k = weight.shape
    size = k if args.group_size is None else args.group_size
    grouped = weight.reshape(n, k // size, size)
    return calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)


def _scheme(args: Any) -> Any:
    from compressed_tensors.quantization import QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=args)


def _compress(weight: torch.Tensor, args: Any) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor

    scale, zero_point = _qparams(weight, args)
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
    return PackedQuantizationCompressor.compress(state, _scheme(args))


def decompress(tensors: dict[str, torch.Tensor], args: Any, exact: bool = False) -> torch.Tensor:
    """The package's decompression of one module's tensors ([N, K] in the scales' dtype;
    `exact`: scales upcast to fp32 first, so every product is exact)."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor

    state = {k: v for k, v in tensors.items() if k != "weight_g_idx"}
    if exact:
        state["weight_scale"] = state["weight_scale"].float()
    return PackedQuantizationCompressor.decompress(state, _scheme(args))["weight"]


def compress_weight(
    weight: torch.Tensor, args: Any, perm: torch.Tensor | None = None, exact: bool = False
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the module's checkpoint tensors, the package's decompression [N, K]). `perm`: act-order
    "group", group g holding input channels perm[g * group_size:(g + 1) * group_size]."""
    from compressed_tensors.compressors.pack_quantized import pack_to_int32, unpack_from_int32

    if perm is None:
        tensors = _compress(weight, args)
        return tensors, decompress(tensors, args, exact)
    n, k = weight.shape
    tensors = _compress(weight[:, perm], args)  # groups contiguous
    grouped = decompress(tensors, args, exact)  # [N, K], column j is input channel perm[j]
    reference = torch.empty_like(grouped)
    reference[:, perm] = grouped
    codes = unpack_from_int32(tensors["weight_packed"], 4, torch.Size((n, k)))  # int8 [N, K]
    in_order = torch.empty_like(codes)
    in_order[:, perm] = codes
    tensors["weight_packed"] = pack_to_int32(in_order, 4)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // args.group_size).to(torch.int32)
    tensors["weight_g_idx"] = g_idx
    return tensors, reference


def _quantize_model(model: Any, args: Any) -> Any:
    """The package's lifecycle on `model`: the W4A16 scheme on every Linear but lm_head,
    min-max qparams, compressed in place."""
    from compressed_tensors.compressors.model_compressors.model_compressor import (
        ModelCompressor,
    )
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )

    config = QuantizationConfig(
        config_groups={"group_0": _scheme(args)},
        ignore=["lm_head"],
        quantization_status=QuantizationStatus.FROZEN,
    )
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                scale, zero_point = _qparams(module.weight, args)
                module.weight_scale.copy_(scale)
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    return compressor


def _act_order(quant_dir: Path, source: dict[str, torch.Tensor], args: Any, seed: int) -> dict:
    """Rewrites every projection of the saved checkpoint as act-order "group" (from the
    source weights, a random permutation each); the reference weights, by module."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(quant_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    references = {}
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        module = name.removesuffix(".weight_packed")
        weight = source[f"{module}.weight"]
        perm = torch.randperm(weight.shape[1], generator=generator)
        parts, references[module] = compress_weight(weight, args, perm, exact=True)
        tensors.update({f"{module}.{leaf}": t for leaf, t in parts.items()})
    save_file(tensors, quant_dir / "model.safetensors", metadata={"format": "pt"})
    config_path = quant_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    config_path.write_text(json.dumps(config, indent=2))
    return references


def write_ct_int4_checkpoint(
    model_dir: Path,
    out_dir: Path,
    symmetric: bool = True,
    group_size: int = 128,
    act_order: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> tuple[Path, Path]:
    """(pack-quantized checkpoint dir, reference dir) made from the model in `model_dir`."""
    pytest.importorskip("compressed_tensors", reason=CT_MISSING)
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    quant_dir, ref_dir = out_dir / "ct-int4", out_dir / "ct-int4-reference"
    args = quantization_args(symmetric, group_size)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    source = {k: v.clone() for k, v in model.state_dict().items()}
    compressor = _quantize_model(model, args)
    model.save_pretrained(quant_dir)
    compressor.update_config(str(quant_dir))
    references = _act_order(quant_dir, source, args, seed) if act_order else {}
    modules: dict[str, dict[str, torch.Tensor]] = {}
    reference = {}
    for name, tensor in load_file(quant_dir / "model.safetensors").items():
        module, _, leaf = name.rpartition(".")
        if leaf in PARTS:
            modules.setdefault(module, {})[leaf] = tensor
        else:
            reference[name] = tensor.float()
    for module, parts in modules.items():
        weight = references.get(module)
        if weight is None:
            weight = decompress(parts, args, exact=True)
        reference[f"{module}.weight"] = weight.float().contiguous()
    ref_dir.mkdir(parents=True)
    save_file(reference, ref_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    (ref_dir / "config.json").write_text(json.dumps(config))
    for extra in model_dir.iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            shutil.copy2(extra, ref_dir / extra.name)
            if not (quant_dir / extra.name).exists():
                shutil.copy2(extra, quant_dir / extra.name)
    return quant_dir, ref_dir
