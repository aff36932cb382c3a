"""compressed-tensors checkpoints routed by `format`, and its INT4 weight-only format parsed
(torch-free).

llm-compressor saves every scheme with quant_method "compressed-tensors"; what the tensors
hold is the `format` (top-level, or per config group)::

    format             what                                         parsed by
    "float-quantized"  FP8 weights (FP8, FP8_DYNAMIC)               fp8_checkpoint.py
    "pack-quantized"   4-bit int weights, 8 per int32 (W4A16[_ASYM]) `parse_pack_quantized`
    anything else      refused ("int-quantized" W8A8, "naive-quantized", "sparse-*", ...)

A `pack-quantized` checkpoint becomes one `Int4Scheme` with method "compressed-tensors"
(its tensors: engine/loader/ct_int4_packing.py). What is served, per config group (every
group must give the same scheme):

    weights.num_bits      4 (the 8-bit W8A16 packing is refused)
    weights.type          "int"
    weights.strategy      "group" (group_size 32, 64, 128) or "channel" (group_size -1/None)
    weights.symmetric     true (zero point 8 in our unsigned codes) or false (W4A16_ASYM:
                          `weight_zero_point` tensors)
    weights.actorder      null or "weight"/"static" (calibration order only: the stored
                          tensors are column-ordered as without it), "group"/"dynamic"
                          (`weight_g_idx` [K] gives each input channel's group)
    weights.dynamic       false; block_structure none
    input/output_activations  none (weight-only)
    targets               ["Linear"]; `ignore` lists modules kept in floats (lm_head)
    kv_cache_scheme       none; sparsity_config / transform_config empty
    quantization_status   "compressed" (or absent)

Anything else raises ValueError naming the field and value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.config.weights.fp8_checkpoint import parse_compressed_tensors as parse_fp8
from engine.config.weights.int4_checkpoint import Int4Scheme

CT_INT4_METHOD = "compressed-tensors"
PACK_QUANTIZED = "pack-quantized"
FLOAT_QUANTIZED = "float-quantized"
CT_INT4_GROUP_SIZES = (32, 64, 128)
# actorder values (compressed-tensors' aliases included) -> whether g_idx tensors are stored.
ACTORDER_G_IDX = {None: False, "weight": False, "static": False, "group": True, "dynamic": True}


def _refuse(where: str, field: str, value: Any, served: str) -> ValueError:
    return ValueError(
        f"quantization_config {where}{field}={value!r} is not served (compressed-tensors "
        f"format='{PACK_QUANTIZED}' serves {served})."
    )


def _expect(args: Mapping[str, Any], field: str, allowed: tuple[Any, ...], where: str) -> Any:
    value = args.get(field)
    if value not in allowed:
        raise _refuse(where, field, value, ", ".join(repr(a) for a in allowed))
    return value


def _group_size(weights: Mapping[str, Any], where: str) -> int:
    strategy = _expect(weights, "strategy", ("group", "channel"), where)
    group_size = weights.get("group_size")
    if strategy == "channel":
        if group_size not in (None, -1):
            raise _refuse(where, "group_size", group_size, "none or -1 with strategy 'channel'")
        return -1
    if group_size not in CT_INT4_GROUP_SIZES:
        raise _refuse(where, "group_size", group_size, f"one of {CT_INT4_GROUP_SIZES}")
    return int(group_size)


def _parse_weights(weights: Mapping[str, Any] | None, where: str) -> tuple[int, bool, bool]:
    """(group size, zero points stored, g_idx stored) of one group's weight args."""
    if weights is None:
        raise ValueError(f"quantization_config {where}weights is missing.")
    _expect(weights, "num_bits", (4,), where)
    _expect(weights, "type", ("int",), where)
    symmetric = _expect(weights, "symmetric", (True, False), where)
    _expect(weights, "dynamic", (False,), where)
    if weights.get("block_structure") is not None:
        raise _refuse(where, "block_structure", weights["block_structure"], "none")
    actorder = weights.get("actorder")
    actorder = actorder.lower() if isinstance(actorder, str) else actorder
    if isinstance(actorder, bool):  # older configs: true meant "group"
        actorder = "group" if actorder else None
    if actorder not in ACTORDER_G_IDX:
        raise _refuse(where, "actorder", weights.get("actorder"), "null, 'weight' or 'group'")
    return _group_size(weights, where), not symmetric, ACTORDER_G_IDX[actorder]


def _check_extras(config: Mapping[str, Any]) -> None:
    status = config.get("quantization_status")
    if status not in (None, "compressed"):
        # "frozen" and earlier: float weights beside their scales, not the packed tensors
        raise _refuse("", "quantization_status", status, "'compressed'")
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        value = config.get(field)
        if value:  # None or {} when absent
            raise _refuse("", field, value, "none (weight-only INT4)")


def parse_pack_quantized(config: Mapping[str, Any]) -> Int4Scheme:
    """A compressed-tensors `pack-quantized` config -> its `Int4Scheme`."""
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config.config_groups is empty: no quantized modules.")
    schemes = set()
    for name, group in groups.items():
        where = f"config_groups.{name}."
        _expect(group, "targets", (["Linear"],), where)
        for field in ("input_activations", "output_activations"):
            if group.get(field) is not None:
                raise _refuse(where, field, group[field], "weight-only INT4: none")
        schemes.add(_parse_weights(group.get("weights"), f"{where}weights."))
    if len(schemes) > 1:
        # One scheme per model keeps one layout for the loader; llm-compressor's W4A16
        # recipes write one group.
        raise _refuse("", "config_groups", sorted(groups), "groups that agree on one scheme")
    _check_extras(config)
    group_size, zero_point, g_idx = schemes.pop()
    ignore = tuple(str(name) for name in config.get("ignore") or ())
    return Int4Scheme(CT_INT4_METHOD, group_size, zero_point, 0, g_idx, ignore)


def _formats(config: Mapping[str, Any]) -> set[Any]:
    top = config.get("format")
    groups = config.get("config_groups") or {}
    return {(group or {}).get("format") or top for group in groups.values()} or {top}


def parse_compressed_tensors(config: dict[str, Any]) -> tuple[str, Any]:
    """(engine method, scheme) of a compressed-tensors config, by its `format`."""
    formats = _formats(config)
    if formats == {PACK_QUANTIZED}:
        return CT_INT4_METHOD, parse_pack_quantized(config)
    unserved = [f for f in formats if f not in (PACK_QUANTIZED, FLOAT_QUANTIZED)]
    if unserved or len(formats) > 1:
        value = unserved[0] if unserved else sorted(formats)
        raise ValueError(
            f"quantization_config format={value!r} is not served (compressed-tensors "
            f"checkpoints load in '{FLOAT_QUANTIZED}' FP8 or '{PACK_QUANTIZED}' INT4, one "
            "format per model)."
        )
    return parse_fp8(config)
