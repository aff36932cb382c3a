"""Every benchmark script starts the way scripts/gpu_check.sh and the docs run it
(`python benchmarks/<group>/<name>.py ...` from the repository root), and none of their
names can hide a package.

Run as a script, a file's folder comes first on sys.path: a `benchmarks/kernels.py` once hid
the `kernels` package from every script beside it, and the GPU check's decode and
throughput parts died at import. So no file or folder name under benchmarks/ may be the name
of something importable (the project's packages, the standard library, what is installed),
and each script answers `--help` (a library module, without a main, imports) in a fresh
interpreter with the environment the GPU check gives it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.rglob("*.py") if "__pycache__" not in p.parts)
PROJECT_PACKAGES = {"engine", "kernels", "services", "clients", "pagedserve", "tests"}


def _importable(name: str) -> bool:
    """Whether `name` imports from anywhere but benchmarks/ (the project, stdlib, site)."""
    if name in PROJECT_PACKAGES or name in sys.stdlib_module_names:
        return True
    saved = list(sys.path)
    try:
        sys.path[:] = [
            p for p in sys.path if not Path(p or ".").resolve().is_relative_to(BENCHMARKS)
        ]
        return importlib.util.find_spec(name) is not None
    finally:
        sys.path[:] = saved


def test_benchmarks_are_grouped_and_no_name_shadows_a_package() -> None:
    assert not list(BENCHMARKS.glob("*.py")), "benchmark scripts live in a group folder"
    names = {p.stem for p in SCRIPTS} | {p.name for p in BENCHMARKS.iterdir() if p.is_dir()}
    names.discard("__pycache__")
    assert len(SCRIPTS) >= 27
    assert sorted(n for n in names if _importable(n)) == []


def _start(script: Path) -> tuple[Path, int, str]:
    relative = script.relative_to(ROOT)
    if 'if __name__ == "__main__"' in script.read_text():
        command = [sys.executable, str(relative), "--help"]
    else:  # a library of the others
        module = ".".join(relative.with_suffix("").parts)
        command = [sys.executable, "-c", f"import {module}"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'proto'}")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return relative, done.returncode, done.stdout + done.stderr


def test_every_benchmark_starts_as_the_gpu_check_runs_it() -> None:
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(_start, SCRIPTS))
    failed = {str(path): output[-600:] for path, rc, output in results if rc != 0}
    assert failed == {}
    helps = [output for path, rc, output in results if "usage:" in output]
    assert len(helps) >= 24  # every script with a main printed its usage


def test_the_gpu_check_names_scripts_and_tests_that_exist() -> None:
    """Every benchmark and test path scripts/gpu_check.sh runs is there (a renamed file
    would otherwise surface only on the GPU machine), and bash parses the script."""
    import re

    script = ROOT / "scripts" / "gpu_check.sh"
    text = script.read_text()
    paths = set(re.findall(r"\b((?:benchmarks|tests)/[\w/]+\.py)", text))
    assert {"benchmarks/gpu/serving_sweep.py", "benchmarks/gpu/gpu_decode.py"} <= paths
    assert sorted(p for p in paths if not (ROOT / p).is_file()) == []
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
