"""Small-batch decode on the CPU: every decoder layer of a decode step in one native call.

Owned by the `cpu` attention backend (`CPUAttentionBackend.whole_step_decode`) and called
by the model runner in place of the model's forward when a step is 1..`MAX_ROWS` requests
(`MAX_ROWS_FP32` on fp32 weights) decoding one token each; the model classes know nothing
of it. Such a step is bound by streaming the weights; per layer the modules' dozen ops
(each a Python call, a dispatch and a thread-pool wake-up) cost about as much again, and
that is what this path removes.
Same math as the modules (summed in a different order), on the same cache layout.

Two native paths:
- one fp32 row (`native.decode_token`, cpu_kernels.c): all layers in one parallel region;
- otherwise (2 fp32 rows, or 1..8 rows on quantized weights: GGUF blocks, int8), `decode_step`
  (decode_step_kernels.c), whose projections read each weight row once for all the rows
  and dequantize quantized blocks inside the GEMV (quant_kernels.c's row kernels).

The model provides its layers' tensors and projections by role (`decode_layer_weights`);
the tables of raw addresses the C code walks are built here, once per set of caches.
"""

from __future__ import annotations

from typing import Any

import torch

from engine import native
from engine.attention.backend import AttentionMetadata
from engine.native.decode_step import (
    LINEAR_ROLES,
    decode_step,
    step_layer_table,
    tensor_address,
)
from engine.native.quant import QuantizedWeight, fp32_weight

# Decode batches up to this size take the whole-step path on quantized weights; larger
# ones are compute-bound enough that dequantize + GEMM wins. On fp32 weights the modules'
# oneDNN GEMM beat our row kernels from 4 rows on (benchmarks/cpu_paths/decode_step.py, 1 thread of
# an AVX-512 EPYC: 0.7x at 4 and 8 rows, 1.2x at 2), so fp32 stops at MAX_ROWS_FP32.
MAX_ROWS = 8
MAX_ROWS_FP32 = 2


class CPUDecodeStep:
    def __init__(self, model: Any, layers: list[dict[str, Any]]) -> None:
        self._model = model.model  # the DecoderModel: embed_tokens, rotary_emb, norm, layers
        self._layers = layers
        attn = self._model.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.scale = attn.head_dim, attn.scale
        self.intermediate_size = self._model.layers[0].mlp.intermediate_size
        self.sliding_window = attn.sliding_window  # the same in every layer (see build)
        # Whether every projection is plain fp32 (the one-region batch-1 kernel applies).
        self.fp32 = all(
            layer[role].quant_method is None for layer in layers for role in LINEAR_ROLES
        )
        self._tables: dict[str, tuple[Any, ...]] = {}

    @classmethod
    def build(cls, model: Any) -> CPUDecodeStep | None:
        """The step for `model`, or None where it does not apply (not native fp32 ops, or
        layers this path does not compute)."""
        if getattr(model, "op_impl", None) != "native":
            return None
        layers = model.decode_layer_weights()
        windows = {layer.self_attn.sliding_window for layer in model.model.layers}
        if layers is None or len(windows) > 1:
            return None
        if any(not _native_parts(layer[role]) for layer in layers for role in LINEAR_ROLES):
            return None  # e.g. INT4 layers (engine/layers/int4_linear.py): Triton's
        return cls(model, layers)

    def applies(self, metadata: AttentionMetadata) -> bool:
        """1..MAX_ROWS requests (MAX_ROWS_FP32 on fp32 weights), each decoding one token."""
        rows = metadata.num_actual_tokens
        limit = MAX_ROWS_FP32 if self.fp32 else MAX_ROWS
        return metadata.num_decodes == rows and 1 <= rows <= limit

    def __call__(
        self,
        input_ids: torch.Tensor,  # [rows]
        positions: torch.Tensor,  # [rows]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [rows, hidden_size], after the final norm
        model = self._model
        hidden = model.embed_tokens(input_ids)  # [rows, hidden_size]
        cos, sin = model.rotary_emb.cos_sin(positions, hidden.dtype, metadata.rope_lengths)
        if input_ids.shape[0] == 1 and self.fp32:
            hidden, residual = self._one_fp32_row(hidden, cos, sin, kv_caches, metadata)
            hidden, _ = model.norm(hidden[None], residual[None])
            return hidden
        hidden = hidden.contiguous().clone()  # [rows, hidden_size], overwritten in place
        shape = {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "block_size": kv_caches[0].shape[2],
        }
        residual = decode_step(
            hidden,
            self._table("step", kv_caches, self._step_rows),
            cos.reshape(hidden.shape[0], -1).contiguous(),
            sin.reshape(hidden.shape[0], -1).contiguous(),
            metadata.block_tables,
            metadata.seq_lens,
            metadata.slot_mapping,
            max(metadata.seq_lens_cpu),
            shape,
            model.norm.eps,
            self.scale,
            self.sliding_window,
            kv_caches[0].dtype,
        )
        hidden, _ = model.norm(hidden, residual)
        return hidden

    def _one_fp32_row(
        self,
        hidden: torch.Tensor,  # [1, hidden_size]
        cos: torch.Tensor,  # [1, 1, head_dim]
        sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the last layer's output, the residual
        hidden = hidden.reshape(-1).clone()  # [hidden_size], overwritten in place
        residual = native.decode_token(
            hidden,
            self._table("token", kv_caches, self._token_rows),
            cos.reshape(-1),
            sin.reshape(-1),
            metadata.block_tables[0],
            metadata.seq_lens_cpu[0],
            int(metadata.slot_mapping[0]),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate_size,
            kv_caches[0].shape[2],
            self._model.norm.eps,
            self.scale,
            self.sliding_window,
            kv_caches[0].dtype,
        )
        return hidden, residual

    def _table(self, kind: str, kv_caches: list[torch.Tensor], build: Any) -> torch.Tensor:
        """A [num_layers, fields] int64 address table, built once per set of caches (the
        weights do not move after loading)."""
        key = (len(kv_caches), kv_caches[0].data_ptr(), kv_caches[-1].data_ptr())
        cached = self._tables.get(kind)
        if cached is not None and cached[0] == key:
            return cached[1]
        table, keep = build(kv_caches)
        # The table holds raw addresses: keep what it points into alive with it.
        self._tables[kind] = (key, table, list(kv_caches), keep)
        return table

    def _token_rows(self, kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, list[Any]]:
        cache_dtype = kv_caches[0].dtype  # every layer's cache in one dtype
        if cache_dtype not in native.KV_DTYPE_CODES:
            raise ValueError(f"native decode: kv_cache dtype {cache_dtype}")
        rows = []
        for fields, cache in zip(self._layers, kv_caches, strict=True):
            caches = {"key_cache": cache[0], "value_cache": cache[1]}
            rows.append(
                [
                    tensor_address(caches[name], (cache_dtype,))
                    if name in caches
                    else tensor_address(fields[name])
                    for name in native.DECODE_LAYER_FIELDS
                ]
            )
        return torch.tensor(rows, dtype=torch.int64), []

    def _step_rows(self, kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, list[Any]]:
        layers, keep = [], []
        for fields, cache in zip(self._layers, kv_caches, strict=True):
            layer = {
                "input_norm": fields["input_norm"],
                "post_norm": fields["post_norm"],
                "key_cache": cache[0],
                "value_cache": cache[1],
            }
            for role in LINEAR_ROLES:
                parts = _parts(fields[role])
                keep.append(parts)
                layer[role] = (fields[role].bias, parts)
            layers.append(layer)
        return step_layer_table(layers), keep


def _native_parts(layer: Any) -> bool:
    """Whether the row kernels can take the projection: fp32, or native quantized parts."""
    method = layer.quant_method
    if method is None:
        return True
    parts = getattr(method, "parts", None)  # FP8 kept in FP8 (fp8_linear.py) has none
    return parts is not None and all(isinstance(p, QuantizedWeight) for p in parts)


def _parts(layer: Any) -> list[QuantizedWeight]:
    """A projection's weight as the row kernels take it: its quantized parts, or its fp32
    weight viewed as F32 rows (no copy)."""
    if layer.quant_method is not None:
        return list(layer.quant_method.parts)
    return [fp32_weight(layer.weight)]
