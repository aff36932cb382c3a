"""Which part of the model each rank holds, and the start-up check that the model splits.

Tensor parallelism follows Megatron's layout: attention heads and the MLP's intermediate
dimension are split over the TP ranks of a stage; vocabulary rows of the embedding and the
LM head too (padded up to a multiple of the TP size). KV heads are split with the query
heads; with fewer KV heads than ranks, each rank keeps the one KV head its query heads
read (a replica)::

    9 heads, 3 KV heads, tp=3:   rank r: q heads 3r..3r+2, KV head r
    4 heads, 1 KV head,  tp=2:   rank r: q heads 2r, 2r+1, KV head 0 (replicated)

Pipeline parallelism gives each stage a contiguous range of layers
(``[stage * L // pp, (stage + 1) * L // pp)``); the first stage embeds, the last one
normalises and computes the logits (and keeps the embedding when the LM head is tied to it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.models.registry import get_model_class


@dataclass(frozen=True, slots=True)
class RowSlice:
    """Rows ``[start, start + size)`` of one checkpoint tensor (or of one shard of a fused
    one, whose rows number `full_size`) that this rank keeps."""

    start: int
    size: int
    full_size: int


def split_evenly(total: int, num_parts: int, part: int) -> RowSlice:
    """Part `part` of `total` rows cut into `num_parts` equal parts (`total` divisible)."""
    size = total // num_parts
    return RowSlice(part * size, size, total)


@dataclass(frozen=True, slots=True)
class HeadPartition:
    """One TP rank's attention heads (counts and first index, in heads)."""

    num_heads: int
    head_start: int
    num_kv_heads: int
    kv_head_start: int


def partition_heads(num_heads: int, num_kv_heads: int, tp_rank: int, tp_size: int) -> HeadPartition:
    heads = num_heads // tp_size
    if num_kv_heads >= tp_size:
        kv_heads = num_kv_heads // tp_size
        kv_start = tp_rank * kv_heads
    else:  # replicated: the KV head that this rank's query heads read
        kv_heads = 1
        kv_start = tp_rank * num_kv_heads // tp_size
    return HeadPartition(heads, tp_rank * heads, kv_heads, kv_start)


def vocab_partition(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int, int]:
    """(first row, rows held with padding, rows that exist) of this rank's vocabulary."""
    per_rank = -(-vocab_size // tp_size)
    start = tp_rank * per_rank
    return start, per_rank, max(0, min(per_rank, vocab_size - start))


def layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers stage `pp_rank` computes."""
    return pp_rank * num_layers // pp_size, (pp_rank + 1) * num_layers // pp_size


def verify_parallel_config(hf_config: Any, parallel: Any, engine_args: Any) -> None:
    """Refuses, at start-up and with the numbers, a model that cannot be split as asked."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    model_class = get_model_class(hf_config)
    name = model_class.__name__
    if tp > 1 and not model_class.supports_tensor_parallel:
        raise ValueError(f"{name} does not support tensor_parallel_size > 1 (got {tp}).")
    if pp > 1 and not model_class.supports_pipeline_parallel:
        raise ValueError(f"{name} does not support pipeline_parallel_size > 1 (got {pp}).")
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    if num_heads % tp:
        raise ValueError(
            f"num_attention_heads ({num_heads}) is not divisible by tensor_parallel_size ({tp})."
        )
    if num_kv_heads >= tp and num_kv_heads % tp:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) is not divisible by tensor_parallel_size ({tp})."
        )
    if num_kv_heads < tp and tp % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({tp}) is not a multiple of num_key_value_heads "
            f"({num_kv_heads}), so the KV heads cannot be replicated evenly."
        )
    intermediate = int(getattr(hf_config, "intermediate_size", 0) or 0)
    if intermediate % tp:
        raise ValueError(
            f"intermediate_size ({intermediate}) is not divisible by tensor_parallel_size ({tp})."
        )
    num_layers = int(hf_config.num_hidden_layers)
    if num_layers < pp:
        raise ValueError(
            f"pipeline_parallel_size ({pp}) exceeds num_hidden_layers ({num_layers}): every "
            "stage needs a layer."
        )
    _verify_devices(engine_args.device, tp * pp)


def _verify_devices(device: str, world_size: int) -> None:
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if device != "cuda":
            raise ValueError(
                f"device={device!r}: with several ranks each takes one GPU in "
                "CUDA_VISIBLE_DEVICES order; pass device='cuda'."
            )
        if torch.cuda.device_count() < world_size:
            raise ValueError(
                f"{world_size} ranks need {world_size} GPUs, {torch.cuda.device_count()} visible."
            )
