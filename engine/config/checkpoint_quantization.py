"""Which quantized checkpoint format a model directory holds: config.json's
`quantization_config`, read once by `EngineArgs.create_engine_config`.

One table, one entry per `quant_method`: its parser turns the config dict into the scheme
the loader follows, or raises ValueError naming the field and value it does not serve (a
checkpoint we cannot read exactly is refused, never loaded as garbage). A method in neither
this table nor a family's own list is refused when the model is built
(`refuse_unserved_method`, after the family's `check_config` has had its say, so a family's
own message wins). Torch-free, like the rest of engine/config.

    quant_method   parser                      scheme               loads as
    "awq"          int4_checkpoint.parse_awq   Int4Scheme           engine/loader/int4_weights.py
    "gptq"         int4_checkpoint.parse_gptq  Int4Scheme           engine/loader/int4_weights.py

Families that read their own quantized experts (GPT-OSS's mxfp4) check the config in their
`check_config` and are not in this table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from engine.config.int4_checkpoint import Int4Scheme, parse_awq, parse_gptq

CHECKPOINT_FORMATS: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "awq": parse_awq,
    "gptq": parse_gptq,
}
# Methods a family reads itself (engine/models/*.check_config), passed over here.
FAMILY_FORMATS = ("mxfp4",)


def quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """config.json's `quantization_config` as a plain dict, or None."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):  # a transformers QuantizationConfigMixin
        config = config.to_dict()
    return dict(config)


def checkpoint_method(hf_config: Any) -> str | None:
    """The config's `quant_method` (lower case), or None for an unquantized checkpoint."""
    config = quantization_config(hf_config)
    if config is None:
        return None
    method = config.get("quant_method")
    method = getattr(method, "value", method)  # transformers' enum
    return None if method is None else str(method).lower()


def checkpoint_quantization(hf_config: Any) -> Any:
    """The scheme of the checkpoint's quantized weights (e.g. an `Int4Scheme`), or None
    when the table has no entry for it; ValueError for settings of a listed format that we
    do not serve."""
    parser = CHECKPOINT_FORMATS.get(checkpoint_method(hf_config) or "")
    return None if parser is None else parser(quantization_config(hf_config) or {})


def refuse_unserved_method(hf_config: Any) -> None:
    """NotImplementedError for a `quant_method` that neither this table nor a family reads."""
    method = checkpoint_method(hf_config)
    if method is not None and method not in CHECKPOINT_FORMATS and method not in FAMILY_FORMATS:
        raise NotImplementedError(
            f"quantization_config quant_method={method!r} is not served: quantized "
            f"checkpoints load for quant_method in {sorted(CHECKPOINT_FORMATS)}."
        )


def resolve_checkpoint_quantization(
    requested: str | None, hf_config: Any, world_size: int = 1
) -> str | None:
    """The engine's `quantization` for a quantized checkpoint: its `quant_method` when
    `requested` is "auto" (or names that method); None for an unquantized checkpoint (the
    other methods resolve in quantization.py). ValueError when they disagree."""
    scheme = checkpoint_quantization(hf_config)
    if scheme is None:
        if requested in CHECKPOINT_FORMATS:
            raise ValueError(
                f"quantization={requested!r} needs a checkpoint whose config.json has a "
                f"quantization_config with quant_method {requested!r}; this one has none."
            )
        return None
    method = checkpoint_method(hf_config)
    if requested not in ("auto", method):
        raise ValueError(
            f"the checkpoint is quantized (quant_method={method!r}): quantization must be "
            f"'auto' or {method!r}, got {requested!r}."
        )
    if world_size > 1:
        # Packed tensors are not split between ranks (yet), as for GGUF blocks.
        raise ValueError(
            f"a {method} checkpoint needs tensor_parallel_size x pipeline_parallel_size = 1, "
            f"got {world_size}."
        )
    return method


def stays_quantized_on_cpu(hf_config: Any) -> bool:
    """Whether the checkpoint's weights can stay quantized in the native CPU kernels, which
    take fp32 activations: `dtype="auto"` then stays fp32 on a bf16 CPU, as for GGUF blocks."""
    scheme = checkpoint_quantization(hf_config)
    return isinstance(scheme, Int4Scheme) and scheme.fits_q4_0
