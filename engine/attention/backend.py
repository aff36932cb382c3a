"""The attention-backend interface: one implementation is chosen at start-up.

A step's batch is a flat run of tokens from several requests. Request `r` owns the query
tokens `query_start_loc[r] : query_start_loc[r + 1]`; they are the *last* tokens of its
context of `seq_lens[r]` tokens (earlier ones are already in the paged cache). Decode
requests (one query token) come first in the batch, then prefill chunks::

    tokens:          | d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 |
    query_start_loc:  0    1    2    3             7       9
    seq_lens:         17   5    33   4             130        (p1: 128 cached + 2 new)

Each layer first writes the step's new keys/values into its cache by `slot_mapping`
(slot = block_id * block_size + offset, -1 = padding, skipped) and then attends over the
cache, so a request can read blocks written by another request in the same step (prefix
sharing between the n samples of one prompt relies on this).

KV-cache layout per layer (asserted by the kernels' launchers)::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = keys, 1 = values)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class AttentionMetadata:
    """Per-step inputs shared by every layer's attention call."""

    num_actual_tokens: int  # tokens of real requests (the batch may be padded after them)
    num_decodes: int  # requests with one query token; they come first
    num_decode_tokens: int  # == num_decodes
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, context length incl. this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padding tokens
    # Host copies, so a backend can loop over requests without syncing the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


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
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Causal attention of each request's query tokens over its cached context."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Writes this step's keys/values, then attends (the order every backend needs)."""
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        return self.attend(query, kv_cache, metadata, scale)

    def whole_step_decode(self, model: Any) -> WholeStepDecode | None:
        """A fused path that replaces `model`'s forward for one-token decode steps, if the
        backend has one for it (the runner asks once, after loading); None by default."""
        return None


def get_attention_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """Returns the backend by name.

    `None` picks `triton` on CUDA; elsewhere `cpu` (native decode kernels) on a CPU where
    they build, else `torch`.
    """
    if name is None:
        if device.type == "cuda":
            name = "triton"
        elif device.type == "cpu":
            from engine.native import native_kernels_available

            name = "cpu" if native_kernels_available() else "torch"
        else:
            name = "torch"
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' runs on the CPU, not on {device}.")
        from engine.attention.cpu_backend import CPUAttentionBackend

        return CPUAttentionBackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"attention_backend must be 'cpu', 'torch' or 'triton', got {name!r}.")
