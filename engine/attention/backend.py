"""The attention-backend interface: one implementation is chosen at start-up.

A step's batch is a flat run of tokens from several requests. Request `r` owns the query
tokens `query_start_loc[r] : query_start_loc[r + 1]`; they are the *last* tokens of its
context of `seq_lens[r]` tokens (earlier ones are already in the paged cache). Decode
requests (one query token) come first in the batch, then prefill chunks::

    tokens:          | d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 |
    query_start_loc:  0    1    2    3             7       9
    seq_lens:         17   5    33   4             130        (p1: 128 cached + 2 new)

Each layer first writes the step's new keys/values into its cache by `slot_mapping`
(slot = block_id * block_size + offset) and then attends over the
cache, so a request can read blocks written by another request in the same step (prefix
sharing between the n samples of one prompt relies on this).

KV-cache layout per layer (asserted by the kernels' launchers)::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = keys, 1 = values)
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.native import native_kernels_available

if TYPE_CHECKING:
    from engine.attention.mla import TorchMLAAttention

logger = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    """Per-step inputs shared by every layer's attention call."""

    num_actual_tokens: int  # tokens of the batch (no padding is produced)
    num_decodes: int  # requests with one query token; they come first
    num_decode_tokens: int  # == num_decodes
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, context length incl. this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64
    # Host copies, so a backend can loop over requests without syncing the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # [num_tokens] int64: the rope length of each token's request (Request.rope_length), for
    # the rope types that scale by the sequence's length (longrope, dynamic;
    # engine/config/rope.py); None for the others (and outside scheduled steps).
    rope_lengths: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass(frozen=True)
class AttentionParams:
    """One layer's attention settings, passed with every call: the one argument of the
    backends (`forward`, `attend`) and of their decode / prefill parts that says how a
    layer attends, so a new setting is added here once."""

    scale: float
    # Each query attends to the last `sliding_window` positions up to its own (itself
    # included), as transformers' sliding-window mask does; None = the whole context.
    sliding_window: int | None = None
    # Gemma 2: each score (after the scale) becomes cap * tanh(score / cap); None = as is.
    logits_soft_cap: float | None = None
    # GPT-OSS: [num_heads] fp32, one learned logit per query head that joins the softmax's
    # denominator (exp(sink) added to the sum of exp(scores)) and attends to no value, so a
    # head can put weight "nowhere"; None = no sinks (and no cost).
    sinks: torch.Tensor | None = None
    # An FP8 KV cache's per-tensor scales (stored = key / k_scale): the checkpoint's, else
    # 1.0; only the triton backend takes such a cache (kv_cache_dtype.check_fp8_kv_cache).
    k_scale: float = 1.0
    v_scale: float = 1.0

    def kernel_options(self) -> dict[str, Any]:
        """The keyword arguments every paged-attention kernel launcher takes besides the
        scale (the native C kernels' and the Triton kernels')."""
        return {
            "sliding_window": self.sliding_window,
            "logits_soft_cap": self.logits_soft_cap,
            "sinks": self.sinks,
        }

    def window_start(self, position: int) -> int:
        """The first key position a query at `position` sees."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1)


class DecodeImpl(Protocol):
    """Attention of the decode requests (the first `num_decodes`, one query token each)."""

    def __call__(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        params: AttentionParams,
    ) -> torch.Tensor: ...  # [num_decodes, num_heads, head_dim]


class PrefillImpl(Protocol):
    """Causal attention of the prefill chunks (requests num_decodes..), written into `out`."""

    def __call__(
        self,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim], prefill rows written
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        params: AttentionParams,
        key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]: this step's keys
        value: torch.Tensor | None,
    ) -> None: ...


class KVWriter(Protocol):
    def __call__(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None: ...


class WholeStepDecode(Protocol):
    """A backend's fused replacement of a model's forward for the steps it `applies` to."""

    def applies(self, metadata: AttentionMetadata) -> bool: ...

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor: ...  # [num_tokens, hidden_size], after the final norm


class AttentionBackend(ABC):
    """Paged attention over the layout above. Implementations: `torch`, `cpu`, `triton`."""

    name: str
    # Whether a decode step through this backend can be captured in a CUDA graph and
    # replayed for later steps: every launch reads the step's values from device tensors,
    # and the host values it reads (max_seq_len, seq_lens_cpu) are only upper bounds, which
    # a captured graph sets to max_model_len (engine/worker/cuda_graphs.py). A backend that
    # loops over requests on the host cannot be replayed.
    supports_cuda_graphs: bool = False
    # Whether each row's result is independent of the batch, chunking and split (EngineArgs
    # `batch_invariant`): the model built over it then takes the batch-invariant linears
    # (engine/layers/batch_invariant/, applied by the loader).
    batch_invariant: bool = False

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        """Scatters the step's new keys and values into the cache."""

    @abstractmethod
    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        params: AttentionParams,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Causal attention of each request's query tokens over its cached context."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        params: AttentionParams,
    ) -> torch.Tensor:
        """Writes this step's keys/values, then attends (the order every backend needs)."""
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        return self.attend(query, kv_cache, metadata, params)

    def forward_rotary(
        self,
        qk: torch.Tensor,  # [num_tokens, num_heads + num_kv_heads, head_dim], not yet rotated
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        rotate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]: (c | c), engine/layers/rope.py
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]: (-s | s)
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        params: AttentionParams,
        num_heads: int,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Rotates q and k (the first `num_heads` heads of `qk`, then the key heads) with the
        layer's `rotate`, then `forward`. A backend with a kernel that rotates and writes the
        cache in one pass (triton) overrides this; `qk` may be overwritten."""
        qk = rotate(qk, cos, sin)
        query, key = qk[:, :num_heads], qk[:, num_heads:]
        return self.forward(query, key, value, kv_cache, metadata, params)

    def whole_step_decode(self, model: Any) -> WholeStepDecode | None:
        """A fused path that replaces `model`'s forward for one-token decode steps, if the
        backend has one for it (the runner asks once, after loading); None by default."""
        return None

    def mla_attention(self) -> TorchMLAAttention:
        """Multi-head latent attention over a latent cache, for MLA layers (DeepSeek-V3:
        engine/attention/mla.py). Only a torch implementation exists: every backend hands
        it out, on its device, and a backend with kernels of its own (cpu, triton) says
        once that MLA layers bypass them; the model's other ops keep the backend's."""
        from engine.attention.mla import TorchMLAAttention  # mla.py imports this module

        if self.name != "torch" and not getattr(self, "_mla_logged", False):
            logger.info(
                "Attention backend %r has no multi-head latent attention kernels: MLA "
                "layers run the torch implementation (engine/attention/mla.py).",
                self.name,
            )
            self._mla_logged = True
        return TorchMLAAttention()


class SplitAttentionBackend(AttentionBackend):
    """A backend composed of a KV writer, a decode implementation and a prefill
    implementation: the decode rows (first in the batch) go to one, the prefill chunks to
    the other. The `torch` and `cpu` backends are two such compositions."""

    def __init__(self, writer: KVWriter, decode: DecodeImpl, prefill: PrefillImpl) -> None:
        self.writer, self.decode, self.prefill = writer, decode, prefill

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self.writer(key, value, kv_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        params: AttentionParams,
    ) -> torch.Tensor:
        self.writer(key, value, kv_cache, metadata.slot_mapping)
        return self._attend(query, kv_cache, metadata, params, key, value)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        params: AttentionParams,
    ) -> torch.Tensor:
        return self._attend(query, kv_cache, metadata, params, None, None)

    def _attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        params: AttentionParams,
        key: torch.Tensor | None,  # this step's keys/values, when the caller has them
        value: torch.Tensor | None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        num_decodes = metadata.num_decodes
        if num_decodes == metadata.num_reqs == query.shape[0]:
            return self.decode(query, kv_cache, metadata, params)  # all decode: no copy
        out = query.new_empty(query.shape)  # [num_tokens, num_heads, head_dim]
        if num_decodes > 0:
            out[:num_decodes] = self.decode(query[:num_decodes], kv_cache, metadata, params)
        if metadata.num_reqs > num_decodes:
            self.prefill(out, query, kv_cache, metadata, params, key, value)
        return out


def get_attention_backend(
    name: str | None,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    batch_invariant: bool = False,
) -> AttentionBackend:
    """Returns the backend by name.

    `None` picks `triton` on CUDA; elsewhere `cpu` (native decode kernels) on a CPU where
    they build, else `torch`. `batch_invariant` gives the backend's batch-invariant variant
    (docs/determinism.md; engine/config/batch_invariant.py checks the combination first).
    """
    if name is None:
        if device.type == "cuda":
            name = "triton"
        elif device.type == "cpu":
            name = "cpu" if native_kernels_available() else "torch"
        else:
            name = "torch"
    if batch_invariant and name == "triton":
        from engine.attention.triton_invariant_backend import TritonBatchInvariantAttentionBackend

        return TritonBatchInvariantAttentionBackend(device)
    if batch_invariant:  # the CPU's (a combination refused in engine/config first raises there)
        from engine.attention.cpu_invariant_backend import CPUBatchInvariantAttentionBackend

        return CPUBatchInvariantAttentionBackend(dtype)
    # Each backend module imports this one, and triton_backend needs triton (absent from the
    # CPU image): the chosen backend is imported here.
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' runs on the CPU, not on {device}.")
        from engine.attention.cpu_backend import CPUAttentionBackend

        return CPUAttentionBackend(dtype)
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"attention_backend must be 'cpu', 'torch' or 'triton', got {name!r}.")
