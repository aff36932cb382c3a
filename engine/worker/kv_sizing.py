"""How many KV-cache blocks a runner allocates: split out of the model runner."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from engine.config.resolved import CacheConfig, SchedulerConfig
from engine.worker.cpu_kv_budget import default_cpu_kv_cache_bytes

logger = logging.getLogger(__name__)


def determine_num_blocks(
    cache_config: CacheConfig,
    sched: SchedulerConfig,
    per_block: int,
    gpu_budget: Callable[[float], int] | None,
    block_size: int,
    cache_dtype_name: str,
) -> int:
    """Blocks from the memory budget: an explicit byte budget, the free GPU memory times
    `gpu_memory_utilization` (`gpu_budget`, None on the CPU), or the CPU budget (what the
    scheduler can use, capped by the available memory:
    cpu_kv_budget.default_cpu_kv_cache_bytes). Never more than the scheduler could ever use
    (max_num_seqs full-length sequences). `per_block`: one block's bytes on this rank."""
    max_useful = sched.max_num_seqs * math.ceil(sched.max_model_len / block_size)
    if cache_config.num_gpu_blocks_override is not None:
        num_blocks = cache_config.num_gpu_blocks_override
        source = "num_gpu_blocks_override"
    else:
        if cache_config.kv_cache_memory_bytes is not None:
            budget, source = cache_config.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        elif gpu_budget is not None:  # a GPU
            budget, source = gpu_budget(cache_config.gpu_memory_utilization), "GPU"
        else:
            budget = default_cpu_kv_cache_bytes(max_useful * per_block)
            source = "CPU budget"
        num_blocks = budget // per_block
        num_blocks = min(num_blocks, max_useful)
    if num_blocks < 1:
        raise ValueError(
            f"The KV-cache budget ({source}) holds no block of {per_block} bytes; "
            "raise kv_cache_memory_bytes / gpu_memory_utilization."
        )
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB of %s (%s)",
        num_blocks,
        block_size,
        num_blocks * block_size,
        num_blocks * per_block / 2**20,
        cache_dtype_name,
        source,
    )
    return num_blocks
