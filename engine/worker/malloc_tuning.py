"""glibc heap tuning for the CPU engine: large freed step temporaries stay mapped.

The model runner calls `keep_freed_memory_mapped()` once at start-up on the CPU. Apart from
the runner because it is process-wide C-library configuration (ctypes, glibc's `mallopt`),
not part of running a step, and is a no-op off Linux/glibc.
"""

from __future__ import annotations

import ctypes
import sys

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory_mapped() -> None:
    """Stops glibc from handing large freed blocks back to the kernel between steps.

    A prefill step's temporaries are tens of MB each ([2048, 3072] fp32 is 25 MB). By default
    glibc serves such sizes with mmap (or trims them off the heap top) and returns them on
    free, so every step page-faults them in again, which costs about as much as the
    elementwise op that writes them. With a fixed 32 MiB mmap threshold (glibc's 64-bit
    maximum) and a 512 MiB trim threshold they stay mapped and are reused. Process-wide and
    harmless elsewhere; a no-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 512 << 20)
    except (OSError, AttributeError):  # musl and other C libraries
        return
