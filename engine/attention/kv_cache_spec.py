"""What one layer's paged KV cache holds per token: a property the model declares
(`model.kv_cache_spec`) and the runner allocates and sizes from (engine/worker/).

The block pool, the prefix cache and preemption count blocks and never look inside one, so
only the tensor a block lives in changes with the model::

    PagedKVSpec   (every family with keys and values: Llama, Qwen, Gemma, Mixtral, ...)
        [2, num_blocks, block_size, num_kv_heads, head_dim]      0 = keys, 1 = values
        per token: 2 * num_kv_heads * head_dim elements

    LatentKVSpec  (multi-head latent attention: DeepSeek-V2/V3, Kimi K2)
        [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
                                 '-- latent c --' '- rope key -'
        per token: kv_lora_rank + qk_rope_head_dim elements, shared by every head

A latent entry is the compressed KV after its RMSNorm and the decoupled rope key after its
rotation (engine/attention/mla.py reads it). Plain integers, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class KVCacheSpec(Protocol):
    @property
    def elements_per_token(self) -> int: ...

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class PagedKVSpec:
    """Full keys and values of `num_kv_heads` heads (this rank's)."""

    num_kv_heads: int
    head_dim: int

    @property
    def elements_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class LatentKVSpec:
    """Multi-head latent attention's entry: the latent and the rope key, one per token."""

    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def entry_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def elements_per_token(self) -> int:
        return self.entry_dim

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.entry_dim)
