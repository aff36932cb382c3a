"""FP8 checkpoints of tiny random models, in the Hub's layouts, made in the tests.

- `make_compressed_tensors_fp8(path, scheme)`: llm-compressor's layout, written by the
  `compressed-tensors` package itself (the library llm-compressor saves with): the model's
  Linear layers (not `lm_head`) get the preset scheme ("FP8_DYNAMIC": per-channel weight
  scales and dynamic per-token activations; "FP8": per-tensor weight and static input
  scales; "FP8_BLOCK": a scale per 128x128 block and dynamic per-group activations), scales
  are the weights' (or blocks') absolute maxima over 448 (llm-compressor's min-max
  observer), then the model is compressed and saved with its `quantization_config`.
  transformers loads it back dequantized (`compressed_tensors_reference_kwargs`).
- `make_modelopt_fp8(path, reference)`: NVIDIA ModelOpt's export, written by hand as its
  files are (no ModelOpt package here): per-tensor `weight_scale` and `input_scale` scalars,
  `k_proj.k_scale` / `v_proj.v_scale`, config.json's `quantization_config` with
  quant_method "modelopt" and hf_quant_config.json; `reference` gets the same model with the
  dequantized weights as a plain checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.block_fp8_checkpoints import quantize_blocks
from tests.model_utils import make_tiny_llama

FP8_MAX = 448.0


def make_compressed_tensors_fp8(path: Path, scheme: str = "FP8_DYNAMIC", **llama: Any) -> Path:
    # The package (the dev extra) supports Python >= 3.11 only; the project runs on 3.10.
    pytest.importorskip("compressed_tensors", reason="compressed-tensors needs Python >= 3.11")
    from compressed_tensors.compressors.model_compressors.model_compressor import (
        ModelCompressor,
    )
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from transformers import AutoModelForCausalLM

    source = make_tiny_llama(path.parent / f"{path.name}-source", **llama)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[scheme])},
        ignore=["lm_head"],
        quantization_status=QuantizationStatus.FROZEN,
    )
    apply_quantization_config(model, config, show_progress=False)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if not hasattr(module, "weight_scale"):
                continue
            weight = module.weight.float()
            block = module.quantization_scheme.weights.block_structure
            if block is not None:  # FP8_BLOCK: a scale per block, ragged at the edges
                scale = quantize_blocks(weight, tuple(block))[1]
            elif module.weight_scale.numel() == 1:
                scale = weight.abs().max() / FP8_MAX
            else:
                scale = weight.abs().amax(dim=1, keepdim=True) / FP8_MAX
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "input_scale"):  # static: a calibrated bound, arbitrary here
                module.input_scale.fill_(0.02 + 0.01 * torch.rand(1, generator=generator).item())
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))
    return path


def compressed_tensors_reference_kwargs() -> dict[str, Any]:
    """`from_pretrained` arguments that load a compressed-tensors checkpoint dequantized:
    plain float Linear layers, no activation quantization (the model our CPU path runs)."""
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


def make_modelopt_fp8(
    path: Path, reference: Path, *, kv_cache: bool = True, **llama: Any
) -> tuple[Path, Path]:
    from safetensors.torch import load_file, save_file

    make_tiny_llama(reference, **llama)
    make_tiny_llama(path, **llama)
    tensors = load_file(reference / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith("_proj.weight"):
            scale = tensor.abs().max().float() / FP8_MAX  # []: ModelOpt's per-tensor scalar
            q = (tensor / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            quantized[name] = q
            quantized[f"{module}.weight_scale"] = scale
            quantized[f"{module}.input_scale"] = torch.tensor(0.05)
            dequantized[name] = q.float() * scale
        else:
            quantized[name] = dequantized[name] = tensor
    if kv_cache:
        for name in tensors:
            if name.endswith("self_attn.k_proj.weight"):
                attn = name.removesuffix(".k_proj.weight")
                quantized[f"{attn}.k_proj.k_scale"] = torch.tensor(0.5)
                quantized[f"{attn}.v_proj.v_scale"] = torch.tensor(0.25)
    save_file(quantized, path / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    quant = {
        "quant_algo": "FP8",
        "kv_cache_quant_algo": "FP8" if kv_cache else None,
        "exclude_modules": ["lm_head"],
    }
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", **quant}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    producer = {"name": "modelopt", "version": "0.19.0"}
    (path / "hf_quant_config.json").write_text(
        json.dumps({"producer": producer, "quantization": quant}, indent=2)
    )
    return path, reference
