"""Builds the `pagedserve-client` wheel: `clients/` and the generated API code alone.

    python scripts/build_client_wheel.py            # → dist/pagedserve_client-<v>-py3-none-any.whl
    python scripts/build_client_wheel.py --outdir DIR

The main distribution (`pagedserve`) carries the same two packages with the server; this one
is for machines that only call a server (no torch). It stages clients/ and
proto/pagedserve/ next to clients/packaging/pyproject.toml in a temporary folder, fills in
the main project's version, and runs `python -m build --wheel` there (without build
isolation: setuptools comes from the current environment, so no download is needed).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGING = ROOT / "clients" / "packaging"
_COPY = ("*.py", "*.pyi", "*.proto")


def _copy_package(source: Path, target: Path) -> None:
    """The package's Python, stub and proto files (no caches, no packaging folder)."""
    for pattern in _COPY:
        for path in source.rglob(pattern):
            relative = path.relative_to(source)
            if relative.parts[0] in ("packaging", "__pycache__"):
                continue
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / relative)


def stage(staging: Path) -> None:
    # (tomllib is Python 3.11+; the project's version line is simple enough to read.)
    match = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert match is not None, "no version in pyproject.toml"
    version = match.group(1)
    template = (PACKAGING / "pyproject.toml").read_text()
    pyproject = re.sub(r'^version = "0\.0\.0".*$', f'version = "{version}"', template, flags=re.M)
    (staging / "pyproject.toml").write_text(pyproject)
    shutil.copy2(PACKAGING / "README.md", staging / "README.md")
    _copy_package(ROOT / "clients", staging / "clients")
    _copy_package(ROOT / "proto" / "pagedserve", staging / "pagedserve")


def build(outdir: Path) -> Path:
    """Builds the wheel into `outdir`; returns its path."""
    outdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pagedserve-client-") as tmp:
        staging = Path(tmp)
        stage(staging)
        command = [sys.executable, "-m", "build", "--wheel", "--no-isolation"]
        command += ["--outdir", str(outdir.resolve()), str(staging)]
        subprocess.run(command, check=True, capture_output=True, text=True)
    wheels = sorted(outdir.glob("pagedserve_client-*.whl"), key=lambda p: p.stat().st_mtime)
    return wheels[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outdir", type=Path, default=ROOT / "dist")
    print(build(parser.parse_args().outdir))


if __name__ == "__main__":
    main()
