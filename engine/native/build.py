"""Builds and loads the native kernels (engine/native/*.c).

`cpu_kernels.c` is compiled on first use with the system C compiler (``$CC``, else
``cc``/``gcc``) for the machine it runs on (``-march=native``), and the shared library is
cached under ``$PAGEDSERVE_KERNEL_CACHE_DIR`` (default ``~/.cache/pagedserve/kernels``),
keyed by the source, the flags, the compiler and the CPU, so a later start loads it in
milliseconds. Like the model cache, the library is written to a temporary file and renamed
into place, so processes building at once never see half a file. OpenMP comes from the
runtime torch already loaded (same soname), so torch's and these kernels' threads are one
pool.

Without a compiler, `load_library` raises `NoCompilerError` and `native_kernels_available`
logs why and returns False; the engine then uses pure torch throughout. That is the one
fallback: a compiler that fails on the sources (a bug in them, or a compiler too old for the
flags) or a library that does not load raises `NativeKernelError` from both, naming the
cause, so a broken kernel is never silently replaced by the slow path (nor its tests
skipped). `$PAGEDSERVE_NATIVE_CPU_KERNELS=0` runs without them on purpose.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

KERNEL_CACHE_DIR_ENV = "PAGEDSERVE_KERNEL_CACHE_DIR"
# "0" turns the native kernels off (pure torch everywhere), e.g. to compare the two.
NATIVE_KERNELS_ENV = "PAGEDSERVE_NATIVE_CPU_KERNELS"
# The -march the kernels are compiled for ("native" unless set): "x86-64-v3" builds the
# AVX2 code an AVX2-only CPU would get, so a benchmark can emulate one on an AVX-512 part
# (benchmarks/offline/throughput.py --emulate-isa avx2).
NATIVE_MARCH_ENV = "PAGEDSERVE_NATIVE_MARCH"
_SOURCE = Path(__file__).with_name("cpu_kernels.c")
# Compiled into the same library; quant_kernels.c includes quant_rows.h once per ISA.
_EXTRA_SOURCES = tuple(
    Path(__file__).with_name(f)
    for f in (
        "quant_kernels.c",
        "quant_gemm.c",
        "moe_kernels.c",
        "decode_step_kernels.c",
        "greedy_screen.c",
        "quant_int8.c",
    )
)
_HEADERS = tuple(
    Path(__file__).with_name(h)
    for h in (
        "quant_types.h",
        "quant_fp16.h",
        "quant_rows.h",
        "quant_block32_avx2.h",
        "quant_fused_avx2.h",
        "quant_fused_avx512.h",
        "quant_invariant_avx2.h",
        "quant_gemm_x86.h",
        "kv_dtype.h",
        "cpu_kernels.h",
    )
)
# -ffp-contract=fast: ISO C mode (-std=c11) would otherwise forbid fusing a * b + c into
# one FMA, which the kernels' inner loops are made of (~1.5x on prefill attention).
_BASE_FLAGS = (
    "-O3",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=c11",
    "-ffp-contract=fast",
) + (
    # GCC and clang default to 256-bit vectors on AVX-512 parts; the kernels' loops are
    # long enough that full-width ones win (~1.3x on the scores pass).
    ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()
)


def compile_flags() -> tuple[str, ...]:
    """The compiler flags: `_BASE_FLAGS` and the -march ($PAGEDSERVE_NATIVE_MARCH or native)."""
    march = os.environ.get(NATIVE_MARCH_ENV, "").strip() or "native"
    if not march.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise NativeKernelError(f"${NATIVE_MARCH_ENV}={march!r} is not an -march value.")
    return (f"-march={march}", *_BASE_FLAGS)


_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_SIGNATURES = {
    # out, query, query_stride, scores, key_cache, value_cache, block_tables,
    # block_table_stride, seq_lens, num_reqs, num_heads, num_kv_heads, head_dim, block_size,
    # max_len, window, scale, cap, sinks, num_threads, kv_dtype (window: sliding-window size,
    # 0 = none; cap: attention logit soft-capping, 0 = none; sinks: [num_heads] fp32 attention
    # sinks, NULL = none; kv_dtype: the cache's element type, attention.KV_DTYPE_CODES)
    "paged_decode_attention_f32": [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr]
    + [_i64] * 7
    + [ctypes.c_float, ctypes.c_float, _ptr, ctypes.c_int, _i64],
    # out, residual_out, x, x_stride, residual, weight, rows, cols, eps, num_threads
    "rms_norm_f32": [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, ctypes.c_float, ctypes.c_int],
    # x, x_stride, cos, sin, rows, num_heads, head_dim, num_threads
    "rotary_inplace_f32": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int],
    # key_cache, value_cache, key, value, kv_stride, slot_mapping, rows, row, kv_dtype
    "write_kv_f32": [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64],
    # out, x, x_stride, rows, inter, num_threads
    "silu_and_mul_f32": [_ptr, _ptr, _i64, _i64, _i64, ctypes.c_int],
    # out, out_stride, query, query_stride, key_cache, value_cache, block_tables,
    # block_table_stride, query_start_loc, seq_lens, first_req, num_reqs, num_heads,
    # num_kv_heads, head_dim, block_size, window, scale, cap, sinks, num_threads, kv_dtype
    "paged_prefill_attention": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr]
    + [_i64] * 7
    + [ctypes.c_float, ctypes.c_float, _ptr, ctypes.c_int, _i64],
    # the same arguments: each row computed alike in any chunk or batch (batch_invariant)
    "paged_prefill_attention_invariant": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64]
    + [_ptr, _ptr]
    + [_i64] * 7
    + [ctypes.c_float, ctypes.c_float, _ptr, ctypes.c_int, _i64],
    # hidden, residual, layers, num_layers, scratch, cos, sin, table, seq_len, slot,
    # hidden_size, num_heads, num_kv_heads, head_dim, inter, block_size, window, eps, scale,
    # threads, kv_dtype
    "decode_token_f32": [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr]
    + [_i64] * 9
    + [ctypes.c_float, ctypes.c_float, ctypes.c_int, _i64],
    # out, x, x_stride, rows (or NULL), w, offsets, num_experts, n, k, num_threads
    "moe_grouped_gemm_f32": [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int],
    # out, x, row_stride, rows, cols, num_threads
    "argmax_rows_f32": [_ptr, _ptr, _i64, _i64, _i64, ctypes.c_int],
}


class NativeKernelError(RuntimeError):
    """The C kernels could not be built or loaded here (the message says why)."""


class NoCompilerError(NativeKernelError):
    """No C compiler on this machine: the one reason the engine runs without the kernels
    unasked (and their tests skip)."""


def kernel_cache_dir() -> Path:
    root = os.environ.get(KERNEL_CACHE_DIR_ENV)
    return Path(root) if root else Path.home() / ".cache" / "pagedserve" / "kernels"


@functools.cache
def load_library() -> ctypes.CDLL:
    """Builds (once per machine and source) and loads the kernels; raises NativeKernelError."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NoCompilerError("no C compiler found (set CC, or install gcc)")
    source = b"\0".join(p.read_bytes() for p in (_SOURCE, *_EXTRA_SOURCES, *_HEADERS))
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    except FileNotFoundError as error:
        raise NoCompilerError(f"no C compiler at {compiler!r}: {error}") from error
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeKernelError(f"C compiler {compiler!r} does not run: {error}") from error
    key = hashlib.sha256()
    flags = compile_flags()
    for part in (source, " ".join(flags).encode(), version.encode(), _cpu_signature()):
        key.update(part)
        key.update(b"\0")
    path = kernel_cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if not path.exists():
        _build(compiler, path, flags)
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        raise NativeKernelError(f"cannot load {path}: {error}") from error
    for name, argtypes in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = None
    return library


@functools.cache
def native_kernels_available() -> bool:
    """Whether the kernels are enabled and a C compiler exists here (logs why not); raises
    `NativeKernelError` where a compiler exists but the build or the load fails."""
    if os.environ.get(NATIVE_KERNELS_ENV, "1") == "0":
        return False
    try:
        load_library()
    except NoCompilerError as error:
        _warn_once(str(error))
        return False
    except NativeKernelError as error:
        raise NativeKernelError(
            f"{error}\n(${NATIVE_KERNELS_ENV}=0 runs without the native CPU kernels)"
        ) from error
    return True


def _warn_once(reason: str) -> None:
    logger.warning("CPU attention kernels unavailable (%s); using pure-torch attention.", reason)


def _build(
    compiler: str, path: Path, flags: tuple[str, ...], sources: tuple[Path, ...] = ()
) -> None:
    """Compiles `sources` (default: the kernels' own) into the library at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    command = [compiler, *flags, *map(str, sources or (_SOURCE, *_EXTRA_SOURCES)), "-o", tmp]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise NativeKernelError(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeKernelError(f"building {path.name} failed: {error}") from error
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("Built the CPU attention kernels: %s", path)


def _cpu_signature() -> bytes:
    """The machine and its CPU feature flags: -march=native code is only valid on them."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|{flags}".encode()
