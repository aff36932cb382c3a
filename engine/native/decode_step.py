"""Wrapper of decode_step_kernels.c: a decode step of a few requests through every decoder
layer in one native call, on fp32 or quantized weights (see the C file's comment).

`step_layer_table` turns each layer's tensors into the int64 address table the C code
walks; `decode_step` checks the per-step inputs and runs the layers.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from engine.native.attention import KV_DTYPE_CODES
from engine.native.build import load_library
from engine.native.quant import QuantizedWeight

MAX_PARTS = 3  # parts of one fused projection (q | k | v in different block types)
LINEAR_ROLES = ("qkv", "o", "gate_up", "down")
_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
CACHE_DTYPES = tuple(KV_DTYPE_CODES)  # fp32, bf16, fp16 (kv_cache_dtype)


@functools.cache
def _lib() -> ctypes.CDLL:
    library = load_library()
    library.decode_step_layer_fields.argtypes = []
    library.decode_step_layer_fields.restype = _i64
    # hidden, residual, layers, num_layers, rows, scratch, cos, sin, block_tables,
    # block_table_stride, seq_lens, slot_mapping, max_len, hidden_size, num_heads,
    # num_kv_heads, head_dim, inter, block_size, window, eps, scale, threads, kv_dtype
    library.decode_step_f32.argtypes = (
        [_ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr]
        + [_i64] * 8
        + [_f32, _f32, ctypes.c_int, _i64]
    )
    library.decode_step_f32.restype = ctypes.c_int
    return library


def tensor_address(
    t: torch.Tensor | None, dtypes: tuple[torch.dtype, ...] = (torch.float32,)
) -> int:
    """A tensor's address for the native layer tables (0 for None); a ValueError for what
    the kernels cannot read (not contiguous CPU memory of one of `dtypes`)."""
    if t is None:
        return 0
    if t.dtype not in dtypes or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(
            "the decode step needs contiguous CPU tensors: fp32 norms and biases, caches of "
            f"one of {tuple(KV_DTYPE_CODES)}"
        )
    return t.data_ptr()


def _linear_fields(bias: torch.Tensor | None, parts: list[QuantizedWeight]) -> list[int]:
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"a projection has 1..{MAX_PARTS} parts, got {len(parts)}")
    fields = [tensor_address(bias)]
    for part in parts:
        scales = 0 if part.scales is None else part.scales.data_ptr()
        fields += [part.data.data_ptr(), int(part.qtype), part.data.shape[1], scales]
        fields.append(part.out_features)
    return fields + [0] * (5 * (MAX_PARTS - len(parts)))


def step_layer_table(layers: list[dict[str, Any]]) -> torch.Tensor:
    """[num_layers, fields] int64 addresses. Each layer: "input_norm", "post_norm",
    "key_cache", "value_cache" tensors and, per role in LINEAR_ROLES, a (bias, parts) pair
    (parts: `QuantizedWeight`s, F32 ones for plain fp32 weights). The caller keeps every
    tensor alive as long as the table."""
    rows = []
    for layer in layers:
        row = [tensor_address(layer[name]) for name in ("input_norm", "post_norm")]
        row += [tensor_address(layer[name], CACHE_DTYPES) for name in ("key_cache", "value_cache")]
        for role in LINEAR_ROLES:
            row += _linear_fields(*layer[role])
        rows.append(row)
    table = torch.tensor(rows, dtype=torch.int64)
    if table.shape[1] != _lib().decode_step_layer_fields():
        raise ValueError("layer table width differs from decode_step_kernels.c's")
    return table


def decode_step(
    hidden: torch.Tensor,  # [rows, hidden_size] fp32, contiguous: in (embeddings) and out
    table: torch.Tensor,  # from step_layer_table
    cos: torch.Tensor,  # [rows, head_dim] (cos | cos)
    sin: torch.Tensor,  # [rows, head_dim] (-sin | sin)
    block_tables: torch.Tensor,  # [>= rows, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= rows] int32, incl. this step's token
    slot_mapping: torch.Tensor,  # [>= rows] int64
    max_len: int,  # >= max(seq_lens[:rows])
    shape: dict[str, int],  # num_heads, num_kv_heads, head_dim, intermediate_size, block_size
    eps: float,
    scale: float,
    window: int | None,
    kv_dtype: torch.dtype = torch.float32,  # every layer's cache's
) -> torch.Tensor:  # [rows, hidden_size], the residual (the caller applies the final norm)
    """Runs every layer of `table` for one decode token per row; `hidden` is overwritten."""
    rows, hidden_size = hidden.shape
    heads, kv_heads, head_dim = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    inter = shape["intermediate_size"]
    _check_inputs(hidden, cos, sin, block_tables, seq_lens, slot_mapping, head_dim)
    qkv = (heads + 2 * kv_heads) * head_dim
    scratch_floats = rows * (hidden_size + qkv + heads * head_dim + 3 * inter + heads * max_len)
    scratch = hidden.new_empty(scratch_floats)
    residual = torch.empty_like(hidden)
    status = _lib().decode_step_f32(
        hidden.data_ptr(),
        residual.data_ptr(),
        table.data_ptr(),
        table.shape[0],
        rows,
        scratch.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        slot_mapping.data_ptr(),
        max_len,
        hidden_size,
        heads,
        kv_heads,
        head_dim,
        inter,
        shape["block_size"],
        window or 0,
        eps,
        scale,
        torch.get_num_threads(),
        KV_DTYPE_CODES[kv_dtype],
    )
    if status != 0:
        raise MemoryError("decode_step_f32 could not allocate its row buffers")
    return residual


def _check_inputs(
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    head_dim: int,
) -> None:
    """The layouts the C code assumes; anything else is a caller bug, reported as such."""
    rows = hidden.shape[0]
    problems = []
    if hidden.dtype != torch.float32 or not hidden.is_contiguous():
        problems.append("hidden is not contiguous fp32")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (rows, head_dim) or not t.is_contiguous() or t.dtype != torch.float32:
            problems.append(f"{name} {tuple(t.shape)} is not contiguous fp32 [{rows}, {head_dim}]")
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        problems.append("block_tables not int32 rows")
    if block_tables.shape[0] < rows:
        problems.append(f"{block_tables.shape[0]} block-table rows for {rows} requests")
    if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous() or seq_lens.numel() < rows:
        problems.append("seq_lens not a contiguous int32 vector")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        problems.append("slot_mapping not a contiguous int64 vector")
    elif slot_mapping.numel() < rows:
        problems.append(f"{slot_mapping.numel()} slots for {rows} rows")
    if problems:
        raise ValueError("decode_step: " + "; ".join(problems))
