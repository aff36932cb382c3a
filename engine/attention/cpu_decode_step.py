"""Batch-1 decode on the CPU: every decoder layer of one token in one native call.

Owned by the `cpu` attention backend (`CPUAttentionBackend.whole_step_decode`) and called
by the model runner in place of the model's forward when a step is one decode token; the
model classes know nothing of it. A batch-1 step is bound by streaming the weights; per
layer the modules' dozen ops (each a Python call, a dispatch and a thread-pool wake-up)
cost about as much again, and that is what this path removes. Same math as the modules
(GEMVs on the unpacked weights, summed in a different order), on the same cache layout.

The model provides its layers' tensors by role (`decode_layer_weights`); the table of raw
addresses the C code walks is built here, once per set of caches.
"""

from __future__ import annotations

from typing import Any

import torch

from engine import native
from engine.attention.backend import AttentionMetadata


class CPUDecodeStep:
    def __init__(self, model: Any, layers: list[dict[str, torch.Tensor | None]]) -> None:
        self._model = model.model  # the DecoderModel: embed_tokens, rotary_emb, norm, layers
        self._layers = layers
        attn = self._model.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.scale = attn.head_dim, attn.scale
        self.intermediate_size = self._model.layers[0].mlp.intermediate_size
        self.sliding_window = attn.sliding_window  # the same in every layer (see build)
        self._table: tuple[Any, ...] | None = None

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
        return cls(model, layers)

    @staticmethod
    def applies(metadata: AttentionMetadata) -> bool:
        """One request decoding one token."""
        return metadata.num_actual_tokens == 1 and metadata.num_decodes == 1

    def __call__(
        self,
        input_ids: torch.Tensor,  # [1]
        positions: torch.Tensor,  # [1]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [1, hidden_size], after the final norm
        model = self._model
        hidden = model.embed_tokens(input_ids)  # [1, hidden_size]
        cos, sin = model.rotary_emb.cos_sin(positions, hidden.dtype)  # [1, 1, head_dim]
        hidden = hidden.reshape(-1).clone()  # [hidden_size], overwritten in place
        residual = native.decode_token(
            hidden,
            self._layer_table(kv_caches),
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
            model.norm.eps,
            self.scale,
            self.sliding_window,
            kv_caches[0].dtype,
        )
        hidden, _ = model.norm(hidden[None], residual[None])
        return hidden

    def _layer_table(self, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """[num_layers, fields] int64 addresses of each layer's weights and caches, built
        once per set of caches (the weights do not move after loading)."""
        key = (len(kv_caches), kv_caches[0].data_ptr(), kv_caches[-1].data_ptr())
        if self._table is not None and self._table[0] == key:
            return self._table[1]

        def address(t: torch.Tensor | None, dtypes: tuple[torch.dtype, ...]) -> int:
            if t is None:
                return 0
            if t.dtype not in dtypes or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(
                    "native decode needs contiguous CPU tensors: fp32 weights, caches of one "
                    f"of {tuple(native.KV_DTYPE_CODES)}"
                )
            return t.data_ptr()

        cache_dtypes = (kv_caches[0].dtype,)  # every layer's cache in one dtype
        if cache_dtypes[0] not in native.KV_DTYPE_CODES:
            raise ValueError(f"native decode: kv_cache dtype {cache_dtypes[0]}")
        rows = []
        for fields, cache in zip(self._layers, kv_caches, strict=True):
            caches = {"key_cache": cache[0], "value_cache": cache[1]}
            rows.append(
                [
                    address(caches[name], cache_dtypes)
                    if name in caches
                    else address(fields[name], (torch.float32,))
                    for name in native.DECODE_LAYER_FIELDS
                ]
            )
        table = torch.tensor(rows, dtype=torch.int64)
        # The table holds raw addresses: keep the caches it points into alive with it.
        self._table = (key, table, list(kv_caches))
        return table
