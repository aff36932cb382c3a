"""Compiles every kernel ahead of time for sm_90 (H100/H200) without a GPU.

The interpreter runs kernels as numpy code, so it cannot catch what only the compiler sees
(unsupported control flow, type mismatches across branches, tile shapes `tl.dot` rejects) or
register spills. Triton ships `ptxas`, so the whole pipeline down to a cubin runs on any
machine. Run as a script in a process without TRITON_INTERPRET (the kernels must be
decorated in compile mode); `test_sm90_compile.py` does that. The cases (which kernels, at
which shapes and configurations) are sm90_compile_cases.py's.

Exit status: 0 = all compiled without spills, 1 = a kernel failed or spilled, 3 = this Triton
version's compile API or a runnable ptxas binary is not available here (the test skips). An
error of ptxas itself (it ran, and rejected what it was given) is a failure like any other.
`--limit N` compiles only the first N cases, `--only TEXT` those whose label holds TEXT.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.kernels.sm90_compile_cases import (
    attention_cases,
    flash_prefill_cases,
    fp8_cache_cases,
    fp8_gemv_cases,
    other_cases,
)
from tests.kernels.sm90_compile_fp8_block import fp8_block_gemm_cases
from tests.kernels.sm90_compile_fp8_moe import fp8_moe_gemm_cases
from tests.kernels.sm90_compile_fp8_moe_w8a8 import fp8_moe_w8a8_cases
from tests.kernels.sm90_compile_fp8_w8a8 import fp8_w8a8_cases

# Integer arguments that are not multiples of 16 in real launches (no divisibility hint).
UNALIGNED_INTS = {"num_reqs", "stride_bt_req", "eps", "scale_log2", "K", "M", "MN"}


def _compile(
    fn: Any, arg_types: dict[str, str], constexprs: dict[str, Any], num_warps: int, num_stages: int
) -> Any:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # The FP8-cache arguments every KV kernel takes: off (a 16-bit cache) unless the case
    # says otherwise (`_fp8_cache_cases`), the scales plain floats.
    arg_names = set(fn.arg_names)
    constexprs = {
        **{name: False for name in ("IS_FP8", "SCALE_IS_PTR") if name in arg_names},
        **constexprs,
    }
    arg_types = {
        **{name: "fp32" for name in ("k_scale", "v_scale") if name in arg_names},
        **arg_types,
    }
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = arg_types.get(name, "i32")
        if signature[name].startswith("*") or name not in UNALIGNED_INTS:
            attrs[(index,)] = [["tt.divisibility", 16]]  # as the JIT specializes them
    source = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _stack_bytes(cubin: bytes) -> int | None:
    """Per-thread stack (spill) bytes from cuobjdump, or None when it is unavailable."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run(
            [str(tool), "--dump-resource-usage", file.name], capture_output=True, text=True
        ).stdout
    match = re.search(r"STACK:(\d+)", usage)
    return int(match.group(1)) if match else None


def _ptxas() -> str | None:
    """The ptxas binary Triton will run for sm_90 ($TRITON_PTXAS_PATH, else its own), or
    None when there is none that runs."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        return get_ptxas(90).path
    except RuntimeError:  # Triton's "Cannot find ptxas": no binary answers --version
        return None


def main(argv: list[str]) -> int:
    limit = int(argv[argv.index("--limit") + 1]) if "--limit" in argv else None
    only = argv[argv.index("--only") + 1] if "--only" in argv else ""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("run without TRITON_INTERPRET: kernels must be decorated in compile mode")
        return 3
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:
        print(f"this Triton has no ahead-of-time compile API: {exc}")
        return 3
    ptxas = _ptxas()
    if ptxas is None:
        print("ptxas is not available: Triton finds no ptxas binary that runs")
        return 3
    print(f"ptxas: {ptxas}")
    failures = 0
    cases = [*attention_cases(), *flash_prefill_cases(), *other_cases()]
    cases += [*fp8_cache_cases(cases), *fp8_gemv_cases(), *fp8_block_gemm_cases()]
    cases += [*fp8_moe_gemm_cases(), *fp8_w8a8_cases(), *fp8_moe_w8a8_cases()]
    for case in cases[:limit]:
        label = case.label
        if only not in label:
            continue
        try:
            kernel = _compile(
                case.kernel, case.arg_types, case.constexprs, case.num_warps, case.num_stages
            )
        except Exception as exc:  # a compile error names the kernel line; ptxas's its own
            print(f"FAIL {label}: {type(exc).__name__}: {exc}")
            failures += 1
            continue
        stack = _stack_bytes(kernel.asm["cubin"])
        spilled = stack is not None and stack > 0
        failures += spilled
        print(f"{'SPILL' if spilled else 'ok':<5} {label}: stack bytes {stack}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
