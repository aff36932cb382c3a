"""transformers' block-scaled FP8 format (`quant_method: "fp8"`), parsed from its config
(torch-free).

DeepSeek-V3/R1 (DeepSeek's own release) and many FP8 checkpoints after it (Qwen/Qwen3-*-FP8,
...) store every quantized projection as an FP8 weight with one float32 scale per
[rows, cols] block of it (transformers reads them with its FineGrainedFP8 integration)::

    config.json  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                 "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                 "modules_to_not_convert": [...]}            (the last one optional)

    <module>.weight            float8_e4m3fn [out, in]
    <module>.weight_scale_inv  float32 [ceil(out / rows), ceil(in / cols)]

    real weight[i, j] = weight[i, j] * weight_scale_inv[i // rows, j // cols]

The edge blocks of a size that is not a multiple of the block are ragged (DeepSeek-V3's
`kv_a_proj_with_mqa` has 576 rows: 4 whole blocks of 128 and one of 64). "inv": the scale
is the inverse of the one the weight was multiplied by when quantized, so it multiplies here.
Modules outside `nn.Linear` (norms, embeddings, DeepSeek's router) and
`modules_to_not_convert` are stored in the checkpoint's dtype.

Served (anything else is refused with the field and value named): `fmt` "e4m3" (or absent),
`activation_scheme` "dynamic", `weight_block_size` two positive sizes, `scale_fmt` "float"
or "ue8m0" (power-of-two scales, DeepSeek-V3.1's; fp32 or float8_e8m0fnu tensors), experts
in FP8. Not served: `weight_block_size` null (per-tensor FP8 under this quant_method: the
producers disagree on the scale tensors' names), static activation scales (no block-scaled
release uses them), FP4 experts and FP8 embedding tables (`modules_to_convert`).
"""

from __future__ import annotations

from typing import Any

from engine.config.weights.fp8_checkpoint import FP8_METHOD, Fp8Scheme, block_shape

_SERVED = {
    "fmt": ("e4m3",),
    "activation_scheme": ("dynamic",),
    "scale_fmt": ("float", "ue8m0"),
    "expert_dtype": ("fp8",),
}
# transformers' defaults for the fields a config may leave out
_DEFAULTS = {
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "scale_fmt": "float",
    "expert_dtype": "fp8",
}


def parse_block_fp8(config: dict[str, Any]) -> tuple[str, Fp8Scheme]:
    """transformers' FineGrainedFP8 config -> ("fp8", a "block" `Fp8Scheme`)."""
    for field, served in _SERVED.items():
        value = config.get(field)
        value = _DEFAULTS[field] if value is None else value
        if isinstance(value, str):
            value = value.lower()
        if value not in served:
            raise ValueError(
                f"quantization_config.{field}={config.get(field)!r} is not served (block-scaled "
                f"FP8 serves {', '.join(repr(s) for s in served)})."
            )
    if config.get("weight_block_size") is None:
        raise ValueError(
            "quantization_config.weight_block_size=None is not served: quant_method 'fp8' "
            "checkpoints load block-scaled (per-tensor FP8 loads as compressed-tensors or "
            "modelopt)."
        )
    block = block_shape(config["weight_block_size"], "weight_block_size")
    if config.get("modules_to_convert"):
        raise ValueError(
            f"quantization_config.modules_to_convert={config['modules_to_convert']!r} is not "
            "served (FP8 embedding tables)."
        )
    ignore = config.get("modules_to_not_convert")
    if ignore is None:
        ignore = config.get("ignored_layers") or ()  # MiniMax's name for it
    scheme = Fp8Scheme("block", "dynamic", tuple(str(m) for m in ignore), False, block)
    return FP8_METHOD, scheme
