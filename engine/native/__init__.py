"""Native fp32 CPU kernels (C built at run time, called via ctypes): paged decode attention
for the `cpu` attention backend, and RMSNorm, rotary embedding and the KV write for the model.

`cpu_kernels.c` is compiled on first use with the system C compiler (``$CC``, else
``cc``/``gcc``) for the machine it runs on (``-march=native``), and the shared library is
cached under ``$PAGEDSERVE_KERNEL_CACHE_DIR`` (default ``~/.cache/pagedserve/kernels``),
keyed by the source, the flags, the compiler and the CPU, so a later start loads it in
milliseconds. Like the model cache, the library is written to a temporary file and renamed
into place, so processes building at once never see half a file.

Why C and not torch: a decode step's attention reads every request's whole context, which
on the paged cache means a gather (`index_select`) into a padded copy first; on a 2-core
CPU the copy alone was a fifth of a batch-64 decode step. These kernels read the blocks in
place. The elementwise kernels each do in one call what took two to five torch ops, which
on a decode step's small tensors is mostly per-op overhead. OpenMP comes from the runtime
torch already loaded (same soname), so torch's and these kernels' threads are one pool.

Without a compiler, `load_library` raises `NativeKernelError` and `native_kernels_available`
logs why and returns False; the engine then uses pure torch throughout.
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

import torch

logger = logging.getLogger(__name__)

KERNEL_CACHE_DIR_ENV = "PAGEDSERVE_KERNEL_CACHE_DIR"
# "0" turns the native kernels off (pure torch everywhere), e.g. to compare the two.
NATIVE_KERNELS_ENV = "PAGEDSERVE_NATIVE_CPU_KERNELS"
_SOURCE = Path(__file__).with_name("cpu_kernels.c")
# -ffp-contract=fast: ISO C mode (-std=c11) would otherwise forbid fusing a * b + c into
# one FMA, which the kernels' inner loops are made of (~1.5x on prefill attention).
_FLAGS = (
    "-O3",
    "-march=native",
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

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_SIGNATURES = {
    # out, query, query_stride, key_cache, block_tables, block_table_stride, seq_lens,
    # num_reqs, num_heads, num_kv_heads, head_dim, block_size, max_len, scale, num_threads
    "paged_decode_scores": [_ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr]
    + [_i64] * 6
    + [ctypes.c_float, ctypes.c_int],
    # out, probs, value_cache, block_tables, block_table_stride, seq_lens,
    # num_reqs, num_heads, num_kv_heads, head_dim, block_size, max_len, num_threads
    "paged_decode_values": [_ptr, _ptr, _ptr, _ptr, _i64, _ptr] + [_i64] * 6 + [ctypes.c_int],
    # out, residual_out, x, x_stride, residual, weight, rows, cols, eps, num_threads
    "rms_norm_f32": [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, ctypes.c_float, ctypes.c_int],
    # x, x_stride, cos, sin, rows, num_heads, head_dim, num_threads
    "rotary_inplace_f32": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int],
    # key_cache, value_cache, key, value, kv_stride, slot_mapping, rows, row
    "write_kv_f32": [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64],
    # out, x, x_stride, rows, inter, num_threads
    "silu_and_mul_f32": [_ptr, _ptr, _i64, _i64, _i64, ctypes.c_int],
    # out, out_stride, query, query_stride, key_cache, value_cache, block_tables,
    # block_table_stride, query_start_loc, seq_lens, first_req, num_reqs, num_heads,
    # num_kv_heads, head_dim, block_size, scale, num_threads
    "paged_prefill_attention": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr]
    + [_i64] * 6
    + [ctypes.c_float, ctypes.c_int],
    # hidden, residual, layers, num_layers, scratch, cos, sin, table, seq_len, slot,
    # hidden_size, num_heads, num_kv_heads, head_dim, inter, block_size, eps, scale, threads
    "decode_token_f32": [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr]
    + [_i64] * 8
    + [ctypes.c_float, ctypes.c_float, ctypes.c_int],
    # out, x, row_stride, rows, cols, num_threads
    "argmax_rows_f32": [_ptr, _ptr, _i64, _i64, _i64, ctypes.c_int],
}

# Fields per layer of `decode_token`'s layer table (the enum in cpu_kernels.c).
DECODE_LAYER_FIELDS = (
    "input_norm",
    "qkv_weight",
    "qkv_bias",
    "o_weight",
    "o_bias",
    "post_norm",
    "gate_up_weight",
    "gate_up_bias",
    "down_weight",
    "down_bias",
    "key_cache",
    "value_cache",
)


class NativeKernelError(RuntimeError):
    """The C kernels could not be built or loaded here (the message says why)."""


def kernel_cache_dir() -> Path:
    root = os.environ.get(KERNEL_CACHE_DIR_ENV)
    return Path(root) if root else Path.home() / ".cache" / "pagedserve" / "kernels"


@functools.cache
def load_library() -> ctypes.CDLL:
    """Builds (once per machine and source) and loads the kernels; raises NativeKernelError."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NativeKernelError("no C compiler found (set CC, or install gcc)")
    source = _SOURCE.read_bytes()
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeKernelError(f"C compiler {compiler!r} does not run: {error}") from error
    key = hashlib.sha256()
    for part in (source, " ".join(_FLAGS).encode(), version.encode(), _cpu_signature()):
        key.update(part)
        key.update(b"\0")
    path = kernel_cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if not path.exists():
        _build(compiler, path)
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
    """Whether the kernels are enabled and `load_library` succeeds here (logs why not)."""
    if os.environ.get(NATIVE_KERNELS_ENV, "1") == "0":
        return False
    try:
        load_library()
    except NativeKernelError as error:
        _warn_once(str(error))
        return False
    return True


def _warn_once(reason: str) -> None:
    logger.warning("CPU attention kernels unavailable (%s); using pure-torch attention.", reason)


def _build(compiler: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    command = [compiler, *_FLAGS, str(_SOURCE), "-o", tmp]
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


def paged_decode_attention(
    query: torch.Tensor,  # [num_reqs, num_heads, head_dim] fp32, rows may be strided
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] fp32
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    max_len: int,  # >= max(seq_lens)
    scale: float,
) -> torch.Tensor:  # [num_reqs, num_heads, head_dim]
    """Attention of one query token per request over its paged context, in place."""
    num_reqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads, cache_head_dim = kv_cache.shape[2:]
    _check(query, kv_cache, block_tables, seq_lens, num_reqs, num_heads, head_dim)
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query [{num_reqs}, {num_heads}, {head_dim}] does not fit the cache "
            f"{tuple(kv_cache.shape)}"
        )
    if num_reqs == 0:
        return query.new_empty(0, num_heads, head_dim)
    library = load_library()
    num_threads = torch.get_num_threads()
    scores = query.new_empty(num_reqs, num_heads, max_len)  # [R, H, max_len]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    sizes = (num_reqs, num_heads, num_kv_heads, head_dim, block_size, max_len)
    library.paged_decode_scores(
        scores.data_ptr(),
        query.data_ptr(),
        query.stride(0),
        key_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        *sizes,
        scale,
        num_threads,
    )
    probs = scores.softmax(-1)  # [R, H, max_len]; padded keys (-inf) get 0
    out = query.new_empty(num_reqs, num_heads, head_dim)
    library.paged_decode_values(
        out.data_ptr(),
        probs.data_ptr(),
        value_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        *sizes,
        num_threads,
    )
    return out


def _check(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    num_heads: int,
    head_dim: int,
) -> None:
    """The layout the C code assumes; anything else is a caller bug, reported as such."""
    problems = []
    if query.dtype != torch.float32 or kv_cache.dtype != torch.float32:
        problems.append(f"dtypes {query.dtype}/{kv_cache.dtype} (need float32)")
    if query.device.type != "cpu" or kv_cache.device.type != "cpu":
        problems.append("tensors off the CPU")
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        problems.append(f"query strides {query.stride()}")
    if kv_cache.dim() != 5 or not kv_cache.is_contiguous():
        problems.append("kv_cache not a contiguous 5-D tensor")
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        problems.append("block_tables not int32 rows")
    if block_tables.shape[0] < num_reqs:
        problems.append(f"{block_tables.shape[0]} block-table rows for {num_reqs} requests")
    if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous() or seq_lens.numel() < num_reqs:
        problems.append("seq_lens not a contiguous int32 vector")
    if problems:
        raise ValueError("paged_decode_attention: " + "; ".join(problems))


def rms_norm(
    x: torch.Tensor,  # [rows, cols] fp32, rows may be strided
    weight: torch.Tensor,  # [cols]
    eps: float,
    residual: torch.Tensor | None = None,  # [rows, cols]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm; with `residual`, returns (rms_norm(x + residual), x + residual)."""
    rows, cols = x.shape
    if x.stride(1) != 1 or not weight.is_contiguous() or weight.numel() != cols:
        raise ValueError(f"rms_norm: x strides {x.stride()}, weight {tuple(weight.shape)}")
    out = x.new_empty(rows, cols)
    summed = None
    if residual is not None:
        if residual.shape != x.shape or not residual.is_contiguous():
            raise ValueError(f"rms_norm: residual {tuple(residual.shape)} for x {tuple(x.shape)}")
        summed = x.new_empty(rows, cols)
    load_library().rms_norm_f32(
        out.data_ptr(),
        None if summed is None else summed.data_ptr(),
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        rows,
        cols,
        eps,
        torch.get_num_threads(),
    )
    return out if summed is None else (out, summed)


def rotary_inplace(
    x: torch.Tensor,  # [rows, num_heads, head_dim] fp32, heads contiguous, rows strided
    cos: torch.Tensor,  # [rows, 1, head_dim] (cos | cos)
    sin: torch.Tensor,  # [rows, 1, head_dim] (-sin | sin)
) -> torch.Tensor:
    """Neox rotary embedding applied in place to `x`, which is returned."""
    rows, num_heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError(f"rotary_inplace: x strides {x.stride()}")
    for table in (cos, sin):
        if table.shape != (rows, 1, head_dim) or not table.is_contiguous():
            raise ValueError(f"rotary_inplace: cos/sin {tuple(table.shape)} for x {tuple(x.shape)}")
    load_library().rotary_inplace_f32(
        x.data_ptr(),
        x.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        rows,
        num_heads,
        head_dim,
        torch.get_num_threads(),
    )
    return x


def write_kv(
    key: torch.Tensor,  # [rows, num_kv_heads, head_dim], heads contiguous, rows strided
    value: torch.Tensor,  # same shape and strides as key
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [>= rows] int64, -1 = skip
) -> None:
    """Scatters each row's keys and values into its cache slot."""
    rows, num_kv_heads, head_dim = key.shape
    row = num_kv_heads * head_dim
    if (
        value.shape != key.shape
        or value.stride() != key.stride()
        or key.stride(2) != 1
        or key.stride(1) != head_dim
        or kv_cache.dim() != 5
        or not kv_cache.is_contiguous()
        or kv_cache.shape[3] * kv_cache.shape[4] != row
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
        or slot_mapping.numel() < rows
    ):
        raise ValueError("write_kv: unsupported shapes, strides or dtypes")
    load_library().write_kv_f32(
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        key.stride(0),
        slot_mapping.data_ptr(),
        rows,
        row,
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [rows, 2 * inter] -> [rows, inter]
    """silu(gate) * up over (gate | up) rows, one pass; rows of x may be strided."""
    rows, width = x.shape
    if x.dtype != torch.float32 or x.stride(1) != 1 or width % 2:
        raise ValueError(f"silu_and_mul: x {tuple(x.shape)} {x.dtype} strides {x.stride()}")
    out = x.new_empty(rows, width // 2)
    load_library().silu_and_mul_f32(
        out.data_ptr(), x.data_ptr(), x.stride(0), rows, width // 2, torch.get_num_threads()
    )
    return out


def paged_prefill_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim] fp32, written for the prefill rows
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] fp32, rows may be strided
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] fp32
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    first_req: int,
    scale: float,
) -> None:
    """Causal attention of requests first_req.. (prefill chunks, any cached context) over
    their paged keys/values, which must already hold this step's tokens."""
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    _check(query, kv_cache, block_tables, seq_lens, num_reqs, num_heads, head_dim)
    problems = []
    if out.dtype != torch.float32 or out.shape != query.shape or out.stride(2) != 1:
        problems.append(f"out {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    elif out.stride(1) != head_dim:
        problems.append(f"out strides {out.stride()}")
    if (
        query_start_loc.dtype != torch.int32
        or not query_start_loc.is_contiguous()
        or query_start_loc.numel() != num_reqs + 1
    ):
        problems.append("query_start_loc not a contiguous int32 vector of num_reqs + 1")
    elif int(query_start_loc[-1]) > num_tokens:
        problems.append(f"query_start_loc ends past the {num_tokens} query rows")
    if kv_cache.shape[4] != head_dim or num_heads % kv_cache.shape[3]:
        problems.append(f"query heads {num_heads}x{head_dim} vs cache {tuple(kv_cache.shape)}")
    if not 0 <= first_req <= num_reqs:
        problems.append(f"first_req {first_req} of {num_reqs}")
    if problems:
        raise ValueError("paged_prefill_attention: " + "; ".join(problems))
    if first_req == num_reqs:
        return
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    load_library().paged_prefill_attention(
        out.data_ptr(),
        out.stride(0),
        query.data_ptr(),
        query.stride(0),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        query_start_loc.data_ptr(),
        seq_lens.data_ptr(),
        first_req,
        num_reqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        torch.get_num_threads(),
    )


def decode_scratch_floats(
    hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, inter: int, seq_len: int
) -> int:
    """Floats of scratch `decode_token` needs (see decode_token_f32 in cpu_kernels.c)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    return hidden_size + 2 * q_size + 2 * kv_size + 3 * inter + num_heads * seq_len


def decode_token(
    hidden: torch.Tensor,  # [hidden_size] fp32: the embedding in, the last MLP output out
    layers: torch.Tensor,  # [num_layers, len(DECODE_LAYER_FIELDS)] int64 addresses
    cos: torch.Tensor,  # [head_dim] (cos | cos) of the token's position
    sin: torch.Tensor,  # [head_dim] (-sin | sin)
    block_table: torch.Tensor,  # [>= ceil(seq_len / block_size)] int32
    seq_len: int,  # context length including this token
    slot: int,  # this token's cache slot
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    block_size: int,
    eps: float,
    scale: float,
) -> torch.Tensor:  # [hidden_size]: the residual stream before the last MLP
    """All decoder layers for one decode token, in place on `hidden` (cpu_kernels.c).

    The caller guarantees what the addresses in `layers` point at: fp32 contiguous weights
    [out, in] of the sizes given, and caches [num_blocks, block_size, Hkv, D] holding `slot`
    and the blocks of `block_table`. The shapes passed here are checked."""
    hidden_size = hidden.shape[0]
    problems = []
    for name, t in (("hidden", hidden), ("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            problems.append(f"{name} not a contiguous fp32 CPU tensor")
    if cos.numel() != head_dim or sin.numel() != head_dim or head_dim % 2:
        problems.append(f"cos/sin of {cos.numel()}/{sin.numel()} for head_dim {head_dim}")
    if layers.dtype != torch.int64 or layers.dim() != 2 or not layers.is_contiguous():
        problems.append("layers not a contiguous int64 table")
    elif layers.shape[1] != len(DECODE_LAYER_FIELDS):
        problems.append(f"layers has {layers.shape[1]} fields")
    if block_table.dtype != torch.int32 or not block_table.is_contiguous():
        problems.append("block_table not contiguous int32")
    elif block_table.numel() * block_size < seq_len or seq_len <= 0:
        problems.append(f"block_table of {block_table.numel()} blocks for {seq_len} tokens")
    if num_heads % num_kv_heads:
        problems.append(f"{num_heads} heads for {num_kv_heads} KV heads")
    if problems:
        raise ValueError("decode_token: " + "; ".join(problems))
    residual = torch.empty_like(hidden)
    scratch = hidden.new_empty(
        decode_scratch_floats(
            hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, seq_len
        )
    )
    load_library().decode_token_f32(
        hidden.data_ptr(),
        residual.data_ptr(),
        layers.data_ptr(),
        layers.shape[0],
        scratch.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        block_table.data_ptr(),
        seq_len,
        slot,
        hidden_size,
        num_heads,
        num_kv_heads,
        head_dim,
        intermediate_size,
        block_size,
        eps,
        scale,
        torch.get_num_threads(),
    )
    return residual


def argmax(x: torch.Tensor) -> torch.Tensor:  # [rows, cols] fp32 -> [rows] int64
    """`x.argmax(dim=-1)` (first index on ties, first NaN if any), rows over the threads:
    torch's CPU argmax runs on one thread, ≈5 ms for a [64, 49152] greedy step."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1 or x.shape[1] == 0:
        raise ValueError(f"argmax: x {tuple(x.shape)} {x.dtype} strides {x.stride()}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    load_library().argmax_rows_f32(
        out.data_ptr(), x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], torch.get_num_threads()
    )
    return out
