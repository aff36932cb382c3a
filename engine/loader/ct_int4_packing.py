"""compressed-tensors `pack-quantized` INT4 tensors (llm-compressor's W4A16 / W4A16_ASYM)
decoded into the AWQ/GPTQ paths' `Int4Weight` (engine/loader/int4_packing.py).

The layout is the `compressed-tensors` package's (its PackedQuantizationCompressor and
pack_to_int32 / unpack_from_int32 helpers); for a projection [out = N, in = K] with G groups::

    weight_packed      int32 [N, ceil(K/8)]  nibble i of [n, c] = q[n, 8c + i] + 8
    weight_scale       [N, G]  in the model's dtype (bf16 / fp16 / fp32)
    weight_shape       int [2] = (N, K)
    weight_zero_point  int32 [ceil(N/8), G]  nibble i of [r, g] = zp[8r + i, g] + 8 (asymmetric)
    weight_g_idx       int32 [K]  the group of each input channel (actorder "group")

with q and zp signed 4-bit (-8..7) and W[n, k] = (q[n, k] - zp[n, g(k)]) * s[n, g(k)],
g(k) = g_idx[k] or k // group_size (and k for no group: "channel", G = 1); symmetric
checkpoints store no zero point (zp = 0). A g_idx holding -1 is one never set by the
calibration: the package then reads the columns in order, and so do we.

Stored +8, the codes are our unsigned codes and the zero points our unsigned zeros
(symmetric: 8), so `Int4Weight` takes them as they are, transposed to GPTQ's packing along
the input; the decoded numbers equal the package's decompression bit for bit
(tests/engine/loader/test_ct_int4_packing.py).
"""

from __future__ import annotations

import torch

from engine.config.weights.int4_checkpoint import Int4Scheme
from engine.loader.int4_packing import (
    PACK,
    SYMMETRIC_ZERO,
    Int4Weight,
    act_order_perm,
    pack_rows,
    unpack_columns,
    unpack_rows,
)

IN_ORDER = tuple(range(PACK))  # nibble i holds element 8c + i


def _shape(name: str, weight_shape: torch.Tensor) -> tuple[int, int]:
    if weight_shape.numel() != 2 or weight_shape.dtype.is_floating_point:
        raise ValueError(f"{name}.weight_shape: expected 2 integers (out, in), got {weight_shape}.")
    n, k = (int(v) for v in weight_shape.flatten().tolist())
    if n <= 0 or k <= 0 or k % PACK:
        raise ValueError(
            f"{name}.weight_shape: ({n}, {k}); INT4 serves projections whose input size is a "
            f"positive multiple of {PACK}."
        )
    return n, k


def _check(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtypes: tuple) -> None:
    if tuple(tensor.shape) != shape or tensor.dtype not in dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(
            f"{name}: expected {names} {list(shape)}, got "
            f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}."
        )


def _groups(name: str, scheme: Int4Scheme, k: int) -> tuple[int, int]:
    group_size = k if scheme.group_size == -1 else scheme.group_size
    if k % group_size:
        raise ValueError(
            f"{name}: {k} input channels are not a multiple of group_size {group_size}."
        )
    return group_size, k // group_size


def _zeros(
    name: str, zero_point: torch.Tensor | None, scheme: Int4Scheme, n: int, num_groups: int
) -> torch.Tensor:
    """The unsigned zero points [N, G] (int32): stored zp + 8, or 8 when symmetric."""
    if zero_point is None:
        if scheme.zero_point:
            raise ValueError(f"{name}.weight_zero_point is missing (symmetric=false needs it).")
        return torch.full((n, num_groups), SYMMETRIC_ZERO, dtype=torch.int32)
    rows = -(-n // PACK)
    _check(f"{name}.weight_zero_point", zero_point, (rows, num_groups), (torch.int32,))
    zeros = unpack_rows(zero_point)[:n].to(torch.int32)  # [N, G]
    if not scheme.zero_point and not bool((zeros == SYMMETRIC_ZERO).all()):
        raise ValueError(
            f"{name}.weight_zero_point: symmetric=true, but the stored zero points are not 0."
        )
    return zeros


def compressed_tensors_to_int4(
    name: str,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    weight_g_idx: torch.Tensor | None,
    scheme: Int4Scheme,
) -> Int4Weight:
    """One `pack-quantized` projection `name` in our layout; ValueError on a misshapen
    tensor (act-order rows sorted by group, as for GPTQ)."""
    n, k = _shape(name, weight_shape)
    group_size, num_groups = _groups(name, scheme, k)
    _check(f"{name}.weight_packed", weight_packed, (n, k // PACK), (torch.int32,))
    floats = (torch.float16, torch.bfloat16, torch.float32)
    _check(f"{name}.weight_scale", weight_scale, (n, num_groups), floats)
    scales = weight_scale.T.contiguous()  # [G, N]
    zeros = _zeros(name, weight_zero_point, scheme, n, num_groups).T.to(scales.dtype)  # [G, N]
    if weight_g_idx is None and scheme.desc_act:
        raise ValueError(f"{name}.weight_g_idx is missing (actorder 'group' needs it).")
    if weight_g_idx is not None and bool((weight_g_idx == -1).any()):
        weight_g_idx = None  # never calibrated: column order (the package's reading)
    perm = act_order_perm(f"{name}.weight_g_idx", weight_g_idx, k, group_size)
    codes = unpack_columns(weight_packed, IN_ORDER).T  # [K, N]
    if perm is not None:
        codes = codes[perm]  # rows sorted by group
    return Int4Weight(pack_rows(codes.contiguous()), scales, zeros.contiguous(), group_size, perm)
