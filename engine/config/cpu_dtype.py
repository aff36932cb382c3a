"""What `dtype="auto"` means on a CPU: bf16 where the CPU computes it natively, else fp32.

bf16 halves the bytes every GEMM and attention step streams, but only CPUs with bf16
arithmetic turn that into speed: AMX-BF16 (Intel Sapphire Rapids and later) and AVX512-BF16
(Intel Cooper Lake and Sapphire Rapids, AMD Zen 4 and 5), which oneDNN (under torch's bf16
GEMMs) uses. Elsewhere every bf16 op widens to fp32 and narrows back, and fp32 with our own
kernels is faster; vLLM's CPU backend makes the same choice. Decided at run time from the
flags the kernel reports in /proc/cpuinfo (torch's `get_cpu_capability` says AVX512 on both
kinds of machine, so it cannot tell them apart). An ISA capped below bf16 for the libraries
(`ONEDNN_MAX_CPU_ISA`, as `benchmarks/offline/throughput.py --emulate-isa avx2` sets it) counts as
no native bf16, so an emulated AVX2 machine resolves as a real one would.

Torch-free: read by `EngineArgs.create_engine_config` (engine_config.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

# Either flag means the CPU multiplies bf16 natively (/proc/cpuinfo spellings).
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) that still include bf16 arithmetic.
_BF16_ISA_CAPS = ("ALL", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10_1_512")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's flags (x86 `flags`, Arm `Features`); empty where unreadable."""
    try:
        with open(cpuinfo) as lines:
            for line in lines:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def native_bf16(flags: Iterable[str], environ: Mapping[str, str] | None = None) -> bool:
    """Whether a CPU with `flags` computes bf16 natively, and no ISA cap forbids it."""
    environ = os.environ if environ is None else environ
    cap = environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if cap and not any(cap.startswith(allowed) for allowed in _BF16_ISA_CAPS):
        return False
    return any(flag in NATIVE_BF16_FLAGS for flag in set(flags))


def cpu_auto_dtype(flags: Iterable[str], environ: Mapping[str, str] | None = None) -> str:
    """`dtype="auto"` on a CPU with `flags`: "bfloat16" where bf16 is native, else "float32"."""
    return "bfloat16" if native_bf16(flags, environ) else "float32"
