"""An INT4 checkpoint (AWQ / GPTQ / compressed-tensors) streamed into the model: each
projection's packed tensors are collected, decoded (engine/loader/int4_packing.py,
ct_int4_packing.py) and then either

- kept in INT4 (`keep`: engine/layers/int4_installer.py; see `Int4Loading` for where), or
- dequantized to the model's dtype and passed on as ``<module>.weight`` to the generic
  loader (the log says so once).

Checkpoint names per quantized module ``<m>`` (`PARTS`): AWQ / GPTQ ``<m>.qweight``,
``<m>.qzeros``, ``<m>.scales`` and (GPTQ) ``<m>.g_idx``; compressed-tensors
``<m>.weight_packed``, ``<m>.weight_scale``, ``<m>.weight_shape`` and, when its scheme has
them, ``<m>.weight_zero_point`` and ``<m>.weight_g_idx``. Its ``<m>.bias`` and every other
tensor pass through as they are. The parts of a module may come in any order, from any
file: a module is decoded when its last part arrives (GPTQ without `g_idx` or symmetric
without `qzeros`: at the end of the stream).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from engine.config.weights.fp8_checkpoint import is_ignored
from engine.config.weights.int4_checkpoint import Int4Scheme
from engine.layers.int4_installer import Int4Installer
from engine.layers.quantization import CPUQuantizedLinearMethod
from engine.loader.ct_int4_packing import compressed_tensors_to_int4
from engine.loader.int4_native import fits_q4_0, int4_to_q4_0
from engine.loader.int4_packing import Int4Weight, awq_to_int4, dequantize_int4, gptq_to_int4
from engine.native import native_kernels_available
from engine.native.quant import concat_rows

logger = logging.getLogger(__name__)

GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
CT_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
# method -> (its tensors' leaf names, the leaf that marks a quantized module)
PARTS = {
    "awq": (GPTQ_PARTS, "qweight"),
    "gptq": (GPTQ_PARTS, "qweight"),
    "compressed-tensors": (CT_PARTS, "weight_packed"),
}


def _required(scheme: Int4Scheme) -> tuple[str, ...]:
    """The parts after which a module is decoded at once."""
    if scheme.method == "awq":
        return ("qweight", "qzeros", "scales")
    if scheme.method == "gptq":
        return GPTQ_PARTS
    optional = {"weight_zero_point": scheme.zero_point, "weight_g_idx": scheme.desc_act}
    return tuple(p for p in CT_PARTS if optional.get(p, True))


def int4_kept_packed(device: torch.device) -> bool:
    """Whether projections stay INT4 on `device` (the Triton kernels), else dequantized."""
    return device.type == "cuda"


def quantized_modules(model_dir: Path, scheme: Int4Scheme) -> list[str]:
    """The modules the directory's safetensors store as INT4 (names ending in .qweight, or
    .weight_packed), read from the files' headers only."""
    from safetensors import safe_open

    suffix = "." + PARTS[scheme.method][1]
    names = []
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names += [n.removesuffix(suffix) for n in f.keys() if n.endswith(suffix)]  # noqa: SIM118
    return names


def _decode_compressed_tensors(
    prefix: str, parts: dict[str, torch.Tensor], scheme: Int4Scheme
) -> Int4Weight:
    missing = [p for p in ("weight_packed", "weight_scale", "weight_shape") if p not in parts]
    if missing:
        raise ValueError(f"INT4 module {prefix!r} lacks {', '.join(missing)}.")
    if is_ignored(prefix, scheme.modules_not_converted):
        raise ValueError(
            f"INT4 module {prefix!r} is stored packed, but quantization_config.ignore "
            f"{list(scheme.modules_not_converted)} names it (a float module)."
        )
    return compressed_tensors_to_int4(
        prefix,
        parts["weight_packed"],
        parts["weight_scale"],
        parts["weight_shape"],
        parts.get("weight_zero_point"),
        parts.get("weight_g_idx"),
        scheme,
    )


def _decode(prefix: str, parts: dict[str, torch.Tensor], scheme: Int4Scheme) -> Int4Weight:
    if scheme.method == "compressed-tensors":
        return _decode_compressed_tensors(prefix, parts, scheme)
    if "qweight" not in parts or "scales" not in parts:
        missing = [p for p in ("qweight", "scales") if p not in parts]
        raise ValueError(f"INT4 module {prefix!r} lacks {', '.join(missing)}.")
    if scheme.method == "awq":
        if "qzeros" not in parts:
            raise ValueError(f"INT4 module {prefix!r} lacks qzeros (AWQ has zero points).")
        return awq_to_int4(prefix, parts["qweight"], parts["qzeros"], parts["scales"], scheme)
    return gptq_to_int4(
        prefix, parts["qweight"], parts.get("qzeros"), parts["scales"], parts.get("g_idx"), scheme
    )


def int4_checkpoint_weights(
    weights: Iterable[tuple[str, Any]],
    scheme: Int4Scheme,
    dtype: torch.dtype,
    keep: Callable[[str, Int4Weight], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) stream with each INT4 module handed to `keep` (which
    returns True when it took it) or else replaced by its dequantized ``.weight``."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    num_dequantized = 0
    leaves, required = PARTS[scheme.method][0], _required(scheme)

    def finish(prefix: str, parts: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal num_dequantized
        weight = _decode(prefix, parts, scheme)
        if keep is None or not keep(prefix, weight):
            num_dequantized += 1
            yield f"{prefix}.weight", dequantize_int4(weight, dtype)

    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in leaves:
            yield name, tensor
            continue
        if not isinstance(tensor, torch.Tensor):  # a lazy safetensors slice, read whole
            tensor = tensor[:]
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if all(p in parts for p in required):
            yield from finish(prefix, pending.pop(prefix))
    for prefix in sorted(pending):
        yield from finish(prefix, pending[prefix])
    if num_dequantized:
        logger.info(
            "Dequantized %d %s INT4 projections to %s at load (no INT4 kernel for them here).",
            num_dequantized,
            scheme.method.upper(),
            str(dtype).removeprefix("torch."),
        )


class Int4Loading:
    """One model's INT4 load: made on the meta-built model (so kept projections never get
    float storage), then `wrap`s the checkpoint stream; `finish` checks every kept layer
    got all its shards. Where projections stay INT4:

        CUDA                                  Triton (engine/layers/int4_linear.py)
        CPU, fp32, symmetric, no act-order    native Q4_0 blocks (engine/loader/int4_native.py)
        otherwise                             dequantized at load to the model's dtype
    """

    def __init__(
        self, model: torch.nn.Module, scheme: Int4Scheme, model_dir: Path, device: torch.device
    ) -> None:
        self.scheme = scheme
        self.dtype = next(model.parameters()).dtype
        self.installer: Int4Installer | None = None
        self.kind = "dequantized"
        make_method: Callable[[str, list[Int4Weight]], Any] | None = None
        if int4_kept_packed(device):
            make_method, self.kind = _triton_method, "Triton kernels"
        elif (
            device.type == "cpu"
            and self.dtype == torch.float32
            and fits_q4_0(scheme)
            and native_kernels_available()
        ):
            make_method, self.kind = _native_method, "native Q4_0 blocks"
        if make_method is not None:
            self.installer = Int4Installer(model, model.packed_modules_mapping, device, make_method)
            self.installer.prepare(quantized_modules(model_dir, scheme))

    @property
    def native(self) -> bool:
        return self.kind == "native Q4_0 blocks"

    def wrap(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
        return int4_checkpoint_weights(weights, self.scheme, self.dtype, self.installer)

    def finish(self) -> None:
        if self.installer is not None:
            self.installer.check_complete()
            logger.info(
                "Kept %d projections in INT4 (%s, %s).",
                self.installer.num_installed,
                self.scheme.method.upper(),
                self.kind,
            )


def _triton_method(name: str, parts: list[Int4Weight]) -> Any:
    # Triton: imported only where its kernels run.
    from engine.layers.int4_linear import Int4LinearMethod

    return Int4LinearMethod(parts)


def _native_method(name: str, parts: list[Int4Weight]) -> CPUQuantizedLinearMethod:
    blocks = [int4_to_q4_0(f"{name} (shard {i})", part) for i, part in enumerate(parts)]
    return CPUQuantizedLinearMethod([concat_rows(blocks)])
