"""INT4 weight-only checkpoints as the Hub stores them: AWQ (GEMM layout) and GPTQ (and,
parsed in ct_int4_checkpoint.py into the same scheme, compressed-tensors `pack-quantized`).

`parse_awq` / `parse_gptq` read a `quantization_config` (the dict in config.json) into one
`Int4Scheme`, or raise ValueError naming the first field whose value we do not serve: a
checkpoint we cannot read exactly is refused at load, never loaded as garbage. The tensor
layouts themselves are engine/loader/int4_packing.py.

What is served (one `Int4Scheme` covers both formats):

    bits        4 only (GPTQ's 2/3/8-bit layouts are refused)
    group_size  32, 64, 128, or -1 (one group over the whole input: per output channel)
    zero point  AWQ `zero_point` true (asymmetric); GPTQ `sym` true or false
    GPTQ        `desc_act` true or false (act-order: any `g_idx` is read exactly);
                `checkpoint_format` "gptq" (v1: zero points stored minus one) or "gptq_v2"
    AWQ         `version` "gemm" (the GEMV and exllama/Marlin-packed layouts are refused)

Torch-free: read by `EngineArgs.create_engine_config`
(engine/config/weights/checkpoint_quantization.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

INT4_GROUP_SIZES = (32, 64, 128, -1)
# The methods whose checkpoints hold INT4 weights, as config.json's `quant_method` names them
# (compressed-tensors' INT4 is its `pack-quantized` format; its FP8 is method "fp8").
INT4_METHODS = ("awq", "gptq", "compressed-tensors")


@dataclass(frozen=True, slots=True)
class Int4Scheme:
    """How one INT4 checkpoint's tensors decode (engine/loader/int4_packing.py)."""

    # Which tensor layout (packing axis, nibble order, tensor names): "awq", "gptq", or
    # "compressed-tensors" (`pack-quantized`: weight_packed along the input of each output
    # row, weight_scale [N, G], weight_zero_point packed along the output, weight_g_idx)
    method: str
    group_size: int  # input channels per scale; -1: all of them (per output channel)
    zero_point: bool  # False: symmetric, the zero point is 8 whatever the checkpoint holds
    zero_offset: int  # added to each stored zero point (GPTQ v1 stores z - 1)
    # act-order: `g_idx` maps input channels to groups in any order (GPTQ `desc_act`,
    # compressed-tensors `actorder` "group")
    desc_act: bool
    # module names kept in floats: AWQ's modules_to_not_convert, compressed-tensors' `ignore`
    modules_not_converted: tuple[str, ...] = ()

    @property
    def fits_q4_0(self) -> bool:
        """Whether every weight repacks exactly into the native CPU kernels' Q4_0 blocks
        (d (q - 8) per 32 inputs: symmetric, no act-order; engine/loader/int4_native.py)."""
        return not self.zero_point and not self.desc_act

    def __post_init__(self) -> None:
        if self.method not in INT4_METHODS:
            raise ValueError(
                f"Int4Scheme.method must be one of {INT4_METHODS}, got {self.method!r}."
            )
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"group_size must be one of {INT4_GROUP_SIZES}, got {self.group_size}."
            )


def _field(config: Mapping[str, Any], method: str, name: str, default: Any) -> Any:
    value = config.get(name, default)
    return default if value is None else value


def _refuse(method: str, name: str, value: Any, served: str) -> ValueError:
    return ValueError(
        f"quantization_config of this {method.upper()} checkpoint: {name}={value!r} is not "
        f"served (we serve {served})."
    )


def _check_bits_and_group(config: Mapping[str, Any], method: str) -> int:
    bits = _field(config, method, "bits", _field(config, method, "w_bit", 4))
    if bits != 4:
        raise _refuse(method, "bits", bits, "bits=4")
    group_size = _field(config, method, "group_size", _field(config, method, "q_group_size", 128))
    if group_size not in INT4_GROUP_SIZES:
        raise _refuse(method, "group_size", group_size, f"group_size in {INT4_GROUP_SIZES}")
    return int(group_size)


def parse_awq(config: Mapping[str, Any]) -> Int4Scheme:
    """AutoAWQ / transformers' AwqConfig: `bits`, `group_size`, `zero_point`, `version`."""
    group_size = _check_bits_and_group(config, "awq")
    version = str(_field(config, "awq", "version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("awq", "version", version, "version='gemm'")
    zero_point = _field(config, "awq", "zero_point", True)
    if zero_point is not True:
        # AWQ without zero points has no agreed tensor layout on the Hub.
        raise _refuse("awq", "zero_point", zero_point, "zero_point=true")
    not_converted = tuple(_field(config, "awq", "modules_to_not_convert", ()))
    return Int4Scheme("awq", group_size, True, 0, False, not_converted)


def parse_gptq(config: Mapping[str, Any]) -> Int4Scheme:
    """AutoGPTQ / GPTQModel / transformers' GPTQConfig: `bits`, `group_size`, `sym`,
    `desc_act`, `checkpoint_format` (GPTQModel also writes it as `format`), `lm_head`."""
    group_size = _check_bits_and_group(config, "gptq")
    sym = _field(config, "gptq", "sym", True)
    if not isinstance(sym, bool):
        raise _refuse("gptq", "sym", sym, "sym=true or false")
    desc_act = _field(config, "gptq", "desc_act", False)
    if not isinstance(desc_act, bool):
        raise _refuse("gptq", "desc_act", desc_act, "desc_act=true or false")
    fmt_name = "checkpoint_format" if "checkpoint_format" in config else "format"
    fmt = str(_field(config, "gptq", fmt_name, "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", fmt_name, fmt, f"{fmt_name}='gptq' or 'gptq_v2'")
    if _field(config, "gptq", "lm_head", False):
        raise _refuse("gptq", "lm_head", True, "lm_head=false (a float LM head)")
    dynamic = _field(config, "gptq", "dynamic", None)
    if dynamic:
        # Per-module overrides of bits / group size (GPTQModel): not read yet.
        raise _refuse("gptq", "dynamic", dynamic, "no per-module overrides")
    return Int4Scheme("gptq", group_size, not sym, 1 if fmt == "gptq" else 0, desc_act)
