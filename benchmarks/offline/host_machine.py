"""The machine a CPU benchmark runs on: its CPU model and the process's peak resident memory
(recorded with every figure), and `--emulate-isa`, which re-executes a benchmark as a CPU
with only that ISA would run it (benchmarks/offline/throughput.py and the cpu_paths
benchmarks use it).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys

# The environment of an AVX2-only machine on a wider CPU (read at import, hence re-exec).
EMULATED_ISA_ENV = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "PAGEDSERVE_NATIVE_MARCH": "x86-64-v3",
        "PAGEDSERVE_QUANT_ISA": "avx2",
    },
    # An AVX-512 machine without bf16 (Skylake-SP / Cascade Lake) on a Sapphire Rapids or
    # Zen 4 one: oneDNN below AVX512-BF16 and AMX, so `dtype="auto"` resolves to fp32 too
    # (engine/config/cpu_dtype.py).
    "avx512": {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
        "PAGEDSERVE_QUANT_ISA": "avx512",
    },
}


def add_emulate_isa_argument(parser: argparse.ArgumentParser) -> None:
    """`--emulate-isa`: the benchmark run as a CPU with only that ISA (`reexec_with_isa`)."""
    parser.add_argument(
        "--emulate-isa",
        choices=sorted(EMULATED_ISA_ENV),
        default=None,
        help="cap every library's and kernel's ISA (an AVX2-only CPU on an AVX-512 one)",
    )


def reexec_with_isa(isa: str) -> None:
    """Re-executes this script with `EMULATED_ISA_ENV[isa]` set, unless it already is."""
    wanted = EMULATED_ISA_ENV[isa]
    if all(os.environ.get(name) == value for name, value in wanted.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **wanted})


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_model() -> str:
    """The CPU's model name (recorded with every figure), from /proc/cpuinfo or platform."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()
