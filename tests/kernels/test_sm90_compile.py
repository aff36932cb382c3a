"""Every kernel compiles for sm_90 (H100/H200) without register spills, GPU or not; the
check skips only where no ptxas binary runs, and an error of ptxas itself fails it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.triton_utils import import_triton

REPO_ROOT = Path(__file__).resolve().parents[2]
CHECK = Path(__file__).with_name("sm90_compile_check.py")
# A ptxas that Triton accepts (it answers --version) and that rejects every input.
BROKEN_PTXAS = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 12.8, V12.8.93"; exit 0; fi
echo "ptxas fatal   : Unresolved extern function 'broken'" >&2
exit 1
"""


def _run_check(*args: str, **env_extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, str(CHECK), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel tests compile them")
def test_kernels_compile_for_sm90_without_spills() -> None:
    result = _run_check()
    report = result.stdout + result.stderr
    if result.returncode == 3:
        pytest.skip(report.strip().splitlines()[-1])
    assert result.returncode == 0, report
    # 12 paged-attention variants, 12 flash-prefill ones (every autotune configuration at
    # Llama-3-8B's shape + 3 layer kinds), 7 other kernels (per-token FP8 quantization
    # included), 5 of them again over an FP8 cache (decode, prefill, flash prefill, both
    # cache writes), and the FP8 GEMV: 11 + 5 + 4 + 4 configurations by row bucket, a
    # per-tensor variant, two with a K tail, its split reduction; the block-scaled FP8 GEMM:
    # 6 + 6 + 6 + 5 configurations by row bucket in 128 x 128 blocks and one with a K tail;
    # the FP8 experts' grouped GEMM: 6 + 6 configurations at row buckets 16 and 64, rows not
    # gathered, a K tail, per channel; the W8A8 block GEMM: 7 configurations at row buckets
    # 16, 64 and 256 in 128 x 128 blocks and 2 + 2 with a K tail, its per-token-group
    # quantization at 2 row tiles; the W8A8 grouped GEMM of FP8 experts: 7 + 7 configurations
    # at row buckets 16 and 64, one ungathered, one with a K tail
    assert report.count("ok ") == 146, report


def test_a_ptxas_error_fails_the_check_rather_than_skipping_it(tmp_path) -> None:
    """ptxas runs and rejects the PTX: its error names ptxas, and must count as a failed
    kernel (exit 1), not as "ptxas is not available" (exit 3, a skip)."""
    import_triton()
    ptxas = tmp_path / "ptxas"
    ptxas.write_text(BROKEN_PTXAS)
    ptxas.chmod(0o755)
    # Triton picks one of its two ptxas tools by version: both point at the broken one.
    paths = {"TRITON_PTXAS_PATH": str(ptxas), "TRITON_PTXAS_BLACKWELL_PATH": str(ptxas)}
    result = _run_check("--limit", "1", **paths)
    report = result.stdout + result.stderr
    assert f"ptxas: {ptxas}" in report, report
    assert result.returncode == 1, report
    assert "FAIL" in report and "ptxas" in report, report
