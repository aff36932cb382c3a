"""Every benchmark script starts the way scripts/gpu_check.sh and the docs run it
(`python benchmarks/<group>/<name>.py ...` from the repository root), and none of their
names can hide a package.

Run as a script, a file's folder comes first on sys.path: a `benchmarks/kernels.py` once hid
the `kernels` package from every script beside it, and the GPU check's decode and
throughput parts died at import. So no file or folder name under benchmarks/ may be the name
of something importable (the project's packages, the standard library, what is installed),
and each script answers `--help` (a library module, without a main, imports) with the
environment the GPU check gives it, started as `python SCRIPT` starts it: in a child forked
from one interpreter that has imported torch (tests/forked_starts.py; one start per script
of that import was most of this test's time), compared once with fresh interpreters.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.rglob("*.py") if "__pycache__" not in p.parts)
FORKED_STARTS = ROOT / "tests" / "forked_starts.py"
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


def _command(script: Path) -> list[str]:
    """What runs `script` from the repository root: `--help`, or the import of a library."""
    relative = script.relative_to(ROOT)
    if 'if __name__ == "__main__"' in script.read_text():
        return [str(relative), "--help"]
    module = ".".join(relative.with_suffix("").parts)  # a library of the others
    return ["-c", f"import {module}"]


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'proto'}")
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, **kwargs
    )


def _start_forked(commands: list[list[str]]) -> list[tuple[int, str]]:
    """Each command as `python COMMAND` would run it, forked from one interpreter that has
    imported torch already (tests/forked_starts.py): ~1 s of the suite per script saved."""
    done = _run([str(FORKED_STARTS)], input=json.dumps(commands), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return [(rc, output) for rc, output in json.loads(done.stdout)]


@pytest.fixture(scope="module")
def shadowed_probe(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A script that fails at import because a file beside it shadows a package (the bug
    this file guards against): its command."""
    folder = tmp_path_factory.mktemp("shadowed")
    (folder / "probe.py").write_text("import kernels.reference\n")
    (folder / "kernels.py").write_text("")  # hides the kernels package from probe.py
    return [str(folder / "probe.py")]


@pytest.fixture(scope="module")
def forked(shadowed_probe: list[str]) -> dict[str, tuple[int, str]]:
    """Every script's start and the probe's, forked: (returncode, output) by first word."""
    commands = [_command(script) for script in SCRIPTS] + [shadowed_probe]
    results = _start_forked(commands)
    return {" ".join(command): result for command, result in zip(commands, results, strict=True)}


def test_every_benchmark_starts_as_the_gpu_check_runs_it(forked) -> None:
    results = [forked[" ".join(_command(script))] for script in SCRIPTS]
    failed = {
        str(path.relative_to(ROOT)): output[-600:]
        for path, (rc, output) in zip(SCRIPTS, results, strict=True)
        if rc != 0
    }
    assert failed == {}
    helps = [output for rc, output in results if "usage:" in output]
    assert len(helps) >= 24  # every script with a main printed its usage


def test_a_forked_start_is_a_fresh_interpreters_start(forked, shadowed_probe) -> None:
    """The forked starts agree with fresh interpreters: the same exit status and output for
    a script with a main, and a script whose import is shadowed fails forked too."""
    main = _command(BENCHMARKS / "offline" / "throughput.py")
    fresh = _run(main, timeout=600)
    assert forked[" ".join(main)] == (0, fresh.stdout + fresh.stderr)
    assert fresh.returncode == 0 and "usage:" in fresh.stdout
    fresh = _run(shadowed_probe, timeout=600)
    rc, output = forked[" ".join(shadowed_probe)]
    assert rc == fresh.returncode == 1
    assert "No module named 'kernels.reference'" in output
    assert "No module named 'kernels.reference'" in fresh.stderr


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


def test_tier_at_rate_runs_a_tiny_burst(tmp_path: Path) -> None:
    """`benchmarks/serving/tier_at_rate.py` end to end, tiny: the stand-in, the real
    tokenizer service and a client process; every figure of the run is there and sane."""
    out = tmp_path / "runs.json"
    done = _run(
        [
            "benchmarks/serving/tier_at_rate.py",
            *("--streams", "4", "--output-len", "12", "--rates", "1000"),
            *("--repeats", "1", "--client-procs", "1", "--json", str(out)),
        ],
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = json.loads(out.read_text())["1000"]
    assert run["target_tokens_per_s"] == 1000
    assert run["tokens_per_s"] > 0 and run["kept_pace"] > 0
    assert 0 < run["client_msgs_per_token"] <= 1.0
    assert run["engine_msgs_per_token"] > 0 and run["gap_p50_ms"] <= run["gap_p99_ms"]
    # /proc counts CPU in clock ticks (10 ms): a tiny burst may cost a process none.
    assert run["tokenizer_cpu_us_per_token"] >= 0 and run["standin_cpu_us_per_token"] >= 0
    assert "rate 1000 tokenizer_cpu_us_per_token: median" in done.stdout
