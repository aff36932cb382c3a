"""The LM head packed for greedy_screen.c's 8-bit screen, and the call that returns each
row's argmax (see the C file for the bound and the rescore; engine/layers/greedy_screen.py
for how the engine uses it).

Packing starts from the LM head as fp32 rows, whatever its storage: a fp32 checkpoint, or
GGUF blocks dequantized a chunk at a time. Each 32 values get one scale (max |w| / 127) and
8-bit quants; the norms of the packed rows and of what the packing lost go with them,
computed in float64 and rounded up, so the bound holds for every weight. An LM head stored
as Q8_0 packs back to its own quants (the loss is zero where a block's largest quant is
±127, as the GGUF quantizer writes them).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.native.quant import QuantizedWeight
from engine.native.quant import _lib as quant_lib

_NR = 16  # vocabulary rows per group (greedy_screen.c's SCREEN_NR)
_KB = 32  # values per block (SCREEN_KB)
# Rows dequantized and packed at a time: never the head whole (at most 1/32 of it, the size
# of its own scales), and few calls: each torch call has a fixed cost, and on a busy machine
# so does each start of its thread pool. At 64 rows a time a 49k-row head took ~1 s of an
# engine's start on a 2-core machine; at up to 2^18 values a time, a few tens of ms.
_PACK_VALUES = 1 << 18


@dataclass(frozen=True)
class ScreenWeights:
    """The packed LM head: `groups` groups of 16 vocabulary rows, `width` values per row
    (the hidden size rounded up to 32)."""

    quants: torch.Tensor  # [groups, width / 32, 8, 16, 4] uint8: quant + 128
    scales: torch.Tensor  # [groups, width / 32, 16] fp32
    loss_norms: torch.Tensor  # [16 groups] fp32: |W_n - Wq_n|, rounded up
    quant_norms: torch.Tensor  # [16 groups] fp32: |Wq_n|, rounded up
    pad: torch.Tensor  # [16 groups] fp32: 0, or -inf on the rows past the vocabulary
    vocab_size: int
    hidden_size: int

    @property
    def width(self) -> int:
        return self.scales.shape[1] * _KB

    @property
    def nbytes(self) -> int:
        tensors = (self.quants, self.scales, self.loss_norms, self.quant_norms, self.pad)
        return sum(t.numel() * t.element_size() for t in tensors)


def pack_chunk_rows(vocab_size: int, width: int) -> int:
    """How many rows `pack_lm_head` packs at a time: a multiple of 16 (whole groups), at most
    2^18 values and 1/32 of the head (rounded down to whole groups), at least one group."""
    rows = min(_PACK_VALUES // width, vocab_size // _KB)
    return max(_NR, rows // _NR * _NR)


def pack_lm_head(
    rows: Callable[[int, int], torch.Tensor],
    vocab_size: int,
    hidden_size: int,
    chunk_rows: int | None = None,
) -> ScreenWeights:
    """Packs the LM head whose fp32 rows [start, end) `rows(start, end)` returns, `chunk_rows`
    rows at a time (a multiple of 16; default `pack_chunk_rows`). Every value is computed
    per row, so the chunking never changes the result (a test packs both ways)."""
    width = -(-hidden_size // _KB) * _KB
    blocks = width // _KB
    groups = -(-vocab_size // _NR)
    padded = groups * _NR
    chunk = pack_chunk_rows(vocab_size, width) if chunk_rows is None else chunk_rows
    if chunk < _NR or chunk % _NR:
        raise ValueError(f"chunk_rows must be a positive multiple of {_NR}, got {chunk}.")
    quants = torch.empty(groups, blocks, _KB // 4, _NR, 4, dtype=torch.uint8)
    scales = torch.zeros(groups, blocks, _NR, dtype=torch.float32)
    loss_norms = torch.zeros(padded, dtype=torch.float32)
    quant_norms = torch.zeros(padded, dtype=torch.float32)
    quants.fill_(128)  # quant 0: the padding rows
    for start in range(0, padded, chunk):
        end = min(start + chunk, padded)
        w = torch.zeros(end - start, width, dtype=torch.float32)
        real = min(end, vocab_size) - start
        if real > 0:
            w[:real, :hidden_size] = rows(start, start + real).float()
        wb = w.view(-1, blocks, _KB)
        scale = wb.abs().amax(dim=-1) / 127.0  # [rows, blocks]
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round(wb * inv[..., None]).clamp_(-127, 127)  # [rows, blocks, 32]
        packed_value = q.double() * scale.double()[..., None]  # exactly what the screen uses
        loss = (wb.double() - packed_value).pow(2).sum(dim=(1, 2)).sqrt()
        norm = packed_value.pow(2).sum(dim=(1, 2)).sqrt()
        slack = 1.0 + 1e-6
        loss_norms[start:end] = (loss * slack).float()
        quant_norms[start:end] = (norm * slack).float()
        g0, g1 = start // _NR, end // _NR
        # [rows, blocks, 32] -> [groups, 16, blocks, 8, 4] -> [groups, blocks, 8, 16, 4]
        grouped = (q + 128).to(torch.uint8).view(g1 - g0, _NR, blocks, _KB // 4, 4)
        quants[g0:g1] = grouped.permute(0, 2, 3, 1, 4)
        scales[g0:g1] = scale.view(g1 - g0, _NR, blocks).permute(0, 2, 1)
    pad = torch.zeros(padded, dtype=torch.float32)
    pad[vocab_size:] = float("-inf")
    if not bool(torch.isfinite(loss_norms).all() and torch.isfinite(quant_norms).all()):
        raise ValueError("the LM head holds values that are not finite.")
    return ScreenWeights(
        quants.contiguous(), scales, loss_norms, quant_norms, pad, vocab_size, hidden_size
    )


class ScreenUnavailable(RuntimeError):
    """This CPU (or the forced kernel path) has no screen, or a row is not finite."""


def supported() -> bool:
    """Whether the screen runs here: on the quantized kernels' AVX-512 path with VNNI, or
    their AVX2 path (also AVX-512 without VNNI); not on the portable one (the path follows
    `PAGEDSERVE_QUANT_ISA` / `quant.set_isa`)."""
    return bool(_lib().greedy_screen_supported())


def screen_argmax(
    weights: ScreenWeights, head: QuantizedWeight, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For [rows, hidden_size] fp32 `hidden`: ([rows] int64 tokens, [rows] int32 counts),
    each row's argmax of its fp32 logits against `head` (the LM head as the model stores
    it; ties to the lowest id) and how many candidates the screen left it. Raises
    ScreenUnavailable (see the class)."""
    rows = hidden.shape[0]
    if head.out_features != weights.vocab_size or head.in_features != weights.hidden_size:
        raise ValueError(f"head {head.out_features}x{head.in_features} is not the packed one.")
    if hidden.shape[1] != weights.width:
        padded = torch.zeros(rows, weights.width, dtype=torch.float32)
        padded[:, : hidden.shape[1]] = hidden
        hidden = padded
    elif hidden.dtype != torch.float32 or hidden.stride(1) != 1:
        hidden = hidden.float().contiguous()
    tokens = torch.empty(rows, dtype=torch.int64)
    counts = torch.empty(rows, dtype=torch.int32)
    status = _lib().greedy_screen_argmax(
        tokens.data_ptr(),
        counts.data_ptr(),
        hidden.data_ptr(),
        hidden.stride(0),
        rows,
        weights.width,
        weights.hidden_size,
        weights.quants.data_ptr(),
        weights.scales.data_ptr(),
        weights.loss_norms.data_ptr(),
        weights.quant_norms.data_ptr(),
        weights.pad.data_ptr(),
        head.data.data_ptr(),
        head.data.shape[1],
        None if head.scales is None else head.scales.data_ptr(),
        int(head.qtype),
        weights.vocab_size,
        torch.get_num_threads(),
    )
    if status == -3:
        raise MemoryError("greedy_screen_argmax could not allocate its buffers.")
    if status != 0:
        raise ScreenUnavailable("not finite" if status == -1 else "no screen on this CPU")
    return tokens, counts


_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "greedy_screen_supported": ([], _int),
    # tokens, counts, h, ld, rows, k_padded, k, quants, scales, loss norms, quant norms,
    # pad, head bytes, head row bytes, head scales, head type, vocab, threads
    "greedy_screen_argmax": (
        [_ptr, _ptr, _ptr, _i64, _i64, _i64, _i64]
        + [_ptr] * 5
        + [_ptr, _i64, _ptr, _int, _i64, _int],
        _int,
    ),
}


@functools.cache
def _lib() -> ctypes.CDLL:
    library = quant_lib()  # applies $PAGEDSERVE_QUANT_ISA, which the screen follows
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = restype
    return library
