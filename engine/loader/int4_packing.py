"""AWQ and GPTQ INT4 tensors decoded into one layout (`Int4Weight`), and dequantized.

A projection [out=N, in=K] with groups of `group_size` input channels (G = K / group_size)
is stored as 4-bit codes q, a scale s and a zero point z per (group, output channel); its
weight is ``W[n, k] = (q[k, n] - z[g(k), n]) * s[g(k), n]``. The formats differ in how they
pack eight codes into an int32 (nibble i holds bits 4i..4i+3)::

    GPTQ  qweight int32 [K / 8, N]  nibble i of [r, n]  = q[8 r + i, n]       (along the input)
          qzeros  int32 [G, N / 8]  nibble i of [g, c]  = z[g, 8 c + i] - 1   (v1; v2: z)
          scales  fp16  [G, N]      g_idx int32 [K]: g(k) (act-order: any order)
    AWQ   qweight int32 [K, N / 8]  nibble i of [k, c]  = q[k, 8 c + AWQ_ORDER[i]]
          qzeros  int32 [G, N / 8]  nibble i of [g, c]  = z[g, 8 c + AWQ_ORDER[i]]
          scales  fp16  [G, N]      g(k) = k // group_size

Symmetric GPTQ (`sym`) has z = 8 whatever qzeros holds. Our `Int4Weight` keeps GPTQ's
packing along the input (what the Triton kernel reads, kernels/int4_gemm.py), scales as
stored (fp16 scales would lose bits in bf16) and zero points unpacked beside them, and for
act-order the input channels sorted by group: row j holds input channel `perm[j]`, so the
layer reads ``x[:, perm]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config.weights.int4_checkpoint import Int4Scheme

# AWQ's GEMM kernels read eight codes in this interleaved order (nibble i -> column).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PACK = 8  # 4-bit codes per int32
SYMMETRIC_ZERO = 8


@dataclass
class Int4Weight:
    qweight: torch.Tensor  # int32 [K / 8, N], packed along the input
    scales: torch.Tensor  # [G, N] as the checkpoint stores them (fp16 or bf16)
    zeros: torch.Tensor  # [G, N] the zero points as numbers, in the scales' dtype
    group_size: int  # input channels per group (K for per-channel)
    perm: torch.Tensor | None  # int64 [K]: row j holds input channel perm[j]; None: identity

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * PACK

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    def to(self, device: torch.device) -> Int4Weight:
        perm = None if self.perm is None else self.perm.to(device)
        return Int4Weight(
            self.qweight.to(device),
            self.scales.to(device),
            self.zeros.to(device),
            self.group_size,
            perm,
        )


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, 4, dtype=torch.int32, device=device)  # [8]


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 codes [8 R, C]: nibble i of [r, c] is row 8 r + i."""
    codes = (packed[:, None, :] >> _shifts(packed.device)[None, :, None]) & 0xF  # [R, 8, C]
    return codes.reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [R, C] -> uint8 codes [R, 8 C]: nibble i of [r, c] is column 8 c + order[i]."""
    codes = (packed[:, :, None] >> _shifts(packed.device)) & 0xF  # [R, C, 8] by nibble
    inverse = [order.index(j) for j in range(PACK)]  # column j sits in nibble inverse[j]
    codes = codes[:, :, inverse]
    return codes.reshape(packed.shape[0], -1).to(torch.uint8)


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [K, N] (0..15) -> int32 [K / 8, N], packed along the rows (GPTQ's way)."""
    k, n = codes.shape
    grouped = codes.to(torch.int32).reshape(k // PACK, PACK, n)
    return (grouped << _shifts(codes.device)[None, :, None]).sum(dim=1, dtype=torch.int32)


def _check_shape(
    name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise ValueError(
            f"{name}: expected {str(dtype).removeprefix('torch.')} {list(shape)}, got "
            f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}."
        )


def _float_dtype(name: str, tensor: torch.Tensor) -> torch.dtype:
    if tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name}: expected fp16, bf16 or fp32, got {tensor.dtype}.")
    return tensor.dtype


def _groups(scheme: Int4Scheme, in_features: int, name: str) -> tuple[int, int]:
    """(group size, number of groups) of a projection with `in_features` inputs."""
    group_size = in_features if scheme.group_size == -1 else scheme.group_size
    if in_features % group_size or in_features % PACK:
        raise ValueError(
            f"{name}: {in_features} input channels are not a multiple of group_size "
            f"{group_size} (and of {PACK})."
        )
    return group_size, in_features // group_size


def awq_to_int4(
    name: str,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    scheme: Int4Scheme,
) -> Int4Weight:
    """One AWQ (GEMM) projection `name` in our layout; ValueError on a misshapen tensor."""
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    group_size, num_groups = _groups(scheme, k, name)
    _check_shape(f"{name}.qweight", qweight, (k, n // PACK), torch.int32)
    _check_shape(f"{name}.qzeros", qzeros, (num_groups, n // PACK), torch.int32)
    _check_shape(f"{name}.scales", scales, (num_groups, n), _float_dtype(f"{name}.scales", scales))
    codes = unpack_columns(qweight, AWQ_ORDER)  # [K, N]
    zeros = unpack_columns(qzeros, AWQ_ORDER).to(scales.dtype)  # [G, N]
    return Int4Weight(pack_rows(codes), scales, zeros, group_size, None)


def gptq_to_int4(
    name: str,
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    scheme: Int4Scheme,
) -> Int4Weight:
    """One GPTQ projection `name` in our layout (act-order rows sorted by group)."""
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    group_size, num_groups = _groups(scheme, k, name)
    _check_shape(f"{name}.scales", scales, (num_groups, n), _float_dtype(f"{name}.scales", scales))
    if scheme.zero_point:
        if qzeros is None:
            raise ValueError(f"{name}.qzeros is missing (sym=false needs zero points).")
        _check_shape(f"{name}.qzeros", qzeros, (num_groups, n // PACK), torch.int32)
        stored = unpack_columns(qzeros, tuple(range(PACK))).to(torch.int32)  # [G, N]
        zeros = ((stored + scheme.zero_offset) & 0xF).to(scales.dtype)  # v1: z - 1 wraps back
    else:
        if qzeros is not None:  # what a symmetric checkpoint stores must say 8
            _check_shape(f"{name}.qzeros", qzeros, (num_groups, n // PACK), torch.int32)
            stored = unpack_columns(qzeros, tuple(range(PACK))).to(torch.int32)
            if not bool(((stored + scheme.zero_offset) & 0xF == SYMMETRIC_ZERO).all()):
                raise ValueError(
                    f"{name}.qzeros: sym=true, but the stored zero points are not "
                    f"{SYMMETRIC_ZERO} (a checkpoint with zero points labelled symmetric?)."
                )
        zeros = torch.full((num_groups, n), SYMMETRIC_ZERO, dtype=scales.dtype)
    if g_idx is None and scheme.desc_act:
        raise ValueError(f"{name}.g_idx is missing (desc_act=true needs it).")
    perm = act_order_perm(f"{name}.g_idx", g_idx, k, group_size)
    if perm is None:
        return Int4Weight(qweight.contiguous(), scales, zeros, group_size, None)
    codes = unpack_rows(qweight)[perm]  # [K, N] rows sorted by group
    return Int4Weight(pack_rows(codes), scales, zeros, group_size, perm)


def act_order_perm(
    name: str, g_idx: torch.Tensor | None, in_features: int, group_size: int
) -> torch.Tensor | None:
    """The rows of an act-order weight sorted by group: int64 [K], row j holds input channel
    perm[j]; None when `g_idx` (each input channel's group) is absent or in column order."""
    if g_idx is None:
        return None
    _check_shape(name, g_idx, (in_features,), g_idx.dtype)
    g_idx = g_idx.to(torch.int64)
    default = torch.arange(in_features, dtype=torch.int64) // group_size
    if torch.equal(g_idx, default):
        return None
    perm = torch.sort(g_idx, stable=True).indices  # [K] input channel per row
    if not torch.equal(g_idx[perm], default):
        raise ValueError(
            f"{name}: groups must each hold group_size={group_size} input channels (this "
            "g_idx does not)."
        )
    return perm


def dequantize_int4(weight: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The projection's [out, in] weight in `dtype`, input channels in checkpoint order;
    computed in fp32 and rounded once."""
    codes = unpack_rows(weight.qweight).to(torch.float32)  # [K, N]
    groups = torch.arange(codes.shape[0], device=codes.device) // weight.group_size  # [K]
    scales = weight.scales.float()[groups]  # [K, N]
    zeros = weight.zeros.float()[groups]
    rows = (codes - zeros) * scales  # [K, N] in our row order
    if weight.perm is not None:
        ordered = torch.empty_like(rows)
        ordered[weight.perm] = rows
        rows = ordered
    return rows.T.contiguous().to(dtype)
