"""The FP8 checkpoint formats people serve on Hopper, parsed from their configs (torch-free).

Two producers write FP8 (E4M3) Llama-shaped checkpoints: llm-compressor (compressed-tensors,
`format: "float-quantized"`) and NVIDIA ModelOpt (`quant_method: "modelopt"`, `quant_algo:
"FP8"`). Both store, per quantized projection::

    <module>.weight        float8_e4m3fn [out, in]
    <module>.weight_scale  float32 [out, 1] (per channel) or [] / [1] (per tensor)
    <module>.input_scale   float32 [] / [1]     (static activation scales only)
    <attn>.k_scale / v_scale  float32 []         (FP8 KV cache scales, when calibrated)

and the real weight is ``weight.float() * weight_scale``. What is served (anything else is
refused with the field and value named):

- compressed-tensors: every config group 8-bit `float` weights, symmetric, static, strategy
  `channel` or `tensor`; input activations absent, or 8-bit float, symmetric, either dynamic
  per `token` or static per `tensor`; targets `Linear`; `ignore` names modules kept in the
  checkpoint's dtype (usually `lm_head`).
- compressed-tensors block-scaled (llm-compressor's FP8_BLOCK): weights strategy `block` with
  a `block_structure` [rows, cols] (`weight_scale` float32 [ceil(out/rows), ceil(in/cols)],
  one scale per block, ragged edge blocks included); input activations absent or dynamic per
  `token` or per `group` (static ones: no block-scaled release uses them).
  The other block-scaled format, transformers' `quant_method: "fp8"` (Qwen3-FP8,
  DeepSeek-V3), is parsed in block_fp8_checkpoint.py into the same scheme.
- modelopt: `quant_algo` FP8 (per-tensor weight and static per-tensor input scales),
  `exclude_modules` (or `ignore`) as the unquantized modules, `kv_cache_quant_algo` FP8 or
  none.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

FP8_METHOD = "fp8"


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How an FP8 checkpoint's projections are stored."""

    # "channel" (a scale per output row), "tensor" (one per matrix) or "block" (one per
    # block_size block: weight_scale [ceil(out / rows), ceil(in / cols)])
    weight_strategy: str
    activation_scheme: str  # "dynamic" (per token, at run time), "static" (input_scale), "none"
    ignore: tuple[str, ...] = ()  # modules left unquantized: names, or "re:<regex>"
    kv_cache_scales: bool = False  # the checkpoint carries k_scale / v_scale for an FP8 cache
    block_size: tuple[int, int] | None = None  # (rows, cols) of a block: "block" only


def _require(config: dict[str, Any], field: str, allowed: tuple[Any, ...], where: str) -> Any:
    value = config.get(field)
    if value not in allowed:
        raise ValueError(
            f"quantization_config {where}{field}={value!r} is not served (FP8 serves "
            f"{', '.join(repr(a) for a in allowed)})."
        )
    return value


def block_shape(value: Any, field: str) -> tuple[int, int]:
    """A [rows, cols] block shape (any positive sizes: dequantized at load, each is exact)."""
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise ValueError(
            f"quantization_config {field}={value!r} is not served (block-scaled FP8 needs "
            "[rows, cols], two positive integers)."
        )
    return int(value[0]), int(value[1])


def _parse_weights(args: dict[str, Any], where: str) -> tuple[str, tuple[int, int] | None]:
    _require(args, "num_bits", (8,), where)
    _require(args, "type", ("float",), where)
    _require(args, "symmetric", (True,), where)
    _require(args, "dynamic", (False,), where)
    strategy = str(_require(args, "strategy", ("channel", "tensor", "block"), where))
    if strategy != "block":
        return strategy, None
    return strategy, block_shape(args.get("block_structure"), f"{where}block_structure")


def _parse_activations(args: dict[str, Any] | None, where: str, block: bool = False) -> str:
    if args is None:
        return "none"  # weight-only FP8 (W8A16)
    _require(args, "num_bits", (8,), where)
    _require(args, "type", ("float",), where)
    _require(args, "symmetric", (True,), where)
    if block:  # llm-compressor's FP8_BLOCK: dynamic per group of 128 inputs (or per token)
        _require(args, "dynamic", (True,), where)
        _require(args, "strategy", ("token", "group"), where)
        return "dynamic"
    if args.get("dynamic") is True:
        _require(args, "strategy", ("token",), where)
        return "dynamic"
    _require(args, "dynamic", (False,), where)
    _require(args, "strategy", ("tensor",), where)
    return "static"


def parse_compressed_tensors(config: dict[str, Any]) -> tuple[str, Fp8Scheme]:
    """compressed-tensors `float-quantized` FP8 (llm-compressor's FP8 / FP8_DYNAMIC)."""
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config.config_groups is empty: no quantized modules.")
    top_format = config.get("format")
    strategies, activations = set(), set()
    for name, group in groups.items():
        where = f"config_groups.{name}."
        fmt = group.get("format") or top_format
        if fmt != "float-quantized":
            raise ValueError(
                f"quantization_config {where}format={fmt!r} is not served "
                "(compressed-tensors checkpoints load in 'float-quantized' FP8)."
            )
        _require(group, "targets", (["Linear"],), where)
        if group.get("output_activations") is not None:
            raise ValueError(f"quantization_config {where}output_activations is not served.")
        weights = group.get("weights")
        if weights is None:
            raise ValueError(f"quantization_config {where}weights is missing.")
        strategy = _parse_weights(weights, f"{where}weights.")
        strategies.add(strategy)
        block = strategy[1] is not None
        inputs = group.get("input_activations")
        activations.add(_parse_activations(inputs, f"{where}input_activations.", block))
    if len(strategies) > 1 or len(activations) > 1:
        # One scheme per model keeps one LinearMethod; mixed groups are not published FP8.
        raise ValueError(
            f"quantization_config.config_groups mix weight strategies {sorted(strategies)} "
            f"or activation schemes {sorted(activations)}; one FP8 scheme per model is served."
        )
    kv = config.get("kv_cache_scheme")
    if kv is not None:
        _require(kv, "num_bits", (8,), "kv_cache_scheme.")
        _require(kv, "type", ("float",), "kv_cache_scheme.")
        _require(kv, "strategy", ("tensor",), "kv_cache_scheme.")
    ignore = tuple(str(name) for name in config.get("ignore") or ())
    strategy, block = strategies.pop()
    return FP8_METHOD, Fp8Scheme(strategy, activations.pop(), ignore, kv is not None, block)


def parse_modelopt(config: dict[str, Any]) -> tuple[str, Fp8Scheme]:
    """ModelOpt FP8: per-tensor weight scales, static per-tensor input scales."""
    _require(config, "quant_algo", ("FP8",), "")
    kv = config.get("kv_cache_quant_algo")
    if kv not in (None, "FP8"):
        raise ValueError(
            f"quantization_config kv_cache_quant_algo={kv!r} is not served (FP8 or none)."
        )
    ignore = config.get("exclude_modules")
    if ignore is None:
        ignore = config.get("ignore") or ()
    return FP8_METHOD, Fp8Scheme("tensor", "static", tuple(str(n) for n in ignore), kv == "FP8")


def is_ignored(module_name: str, ignore: tuple[str, ...]) -> bool:
    """Whether a checkpoint module is one the config leaves unquantized: an exact name, a
    compressed-tensors "re:<regex>" (matched from the start, as compressed-tensors does),
    or a ModelOpt glob ("model.layers.*.mlp.gate"); a bare leaf ("lm_head") also matches
    that module at any depth."""
    for pattern in ignore:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module_name):
                return True
        elif (
            module_name == pattern
            or module_name.endswith("." + pattern)
            or ("*" in pattern and fnmatch.fnmatchcase(module_name, pattern))
        ):
            return True
    return False
