"""The default KV-cache budget on the CPU, in bytes, when the user sets none (the runner
divides it into blocks: kv_sizing.determine_num_blocks)."""

from __future__ import annotations

import os

# The default CPU KV budget is what the scheduler can use (max_num_seqs full-length
# sequences), capped at this fraction of the memory available at start-up: the cache is
# mapped lazily (engine/worker/kv_memory.py), so the cap bounds what a full cache could
# grow to, and half leaves room for the weights, the step's activations and the rest of the
# machine (other processes, the page cache the model files are read through).
CPU_KV_CACHE_MEMORY_FRACTION = 0.5
# Used where the available memory cannot be read (no /proc/meminfo, no psutil).
_FALLBACK_CPU_KV_CACHE_BYTES = 4 * 1024**3
CPU_KVCACHE_SPACE_ENV = "PAGEDSERVE_CPU_KVCACHE_SPACE"


def default_cpu_kv_cache_bytes(useful_bytes: int, available_bytes: int | None = None) -> int:
    """The CPU KV budget when none is set explicitly.

    `PAGEDSERVE_CPU_KVCACHE_SPACE` GiB (like vLLM's CPU knob) wins; else what the scheduler
    can use (`useful_bytes`: max_num_seqs x max_model_len tokens), capped at
    CPU_KV_CACHE_MEMORY_FRACTION of the memory available now (`available_bytes`, default
    MemAvailable), or at 4 GiB where that cannot be read.
    """
    value = os.environ.get(CPU_KVCACHE_SPACE_ENV)
    if value:
        try:
            space = float(value)
        except ValueError:
            space = -1.0
        if not space > 0:
            raise ValueError(
                f"{CPU_KVCACHE_SPACE_ENV} must be a positive GiB count, got {value!r}."
            )
        return int(space * 1024**3)
    if available_bytes is None:
        available_bytes = available_memory_bytes()
    if available_bytes is None:
        cap = _FALLBACK_CPU_KV_CACHE_BYTES
    else:
        cap = int(available_bytes * CPU_KV_CACHE_MEMORY_FRACTION)
    return min(useful_bytes, cap)


def available_memory_bytes() -> int | None:
    """MemAvailable: what the kernel estimates can be allocated now without swapping
    (free memory plus reclaimable caches), or None where it cannot be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
