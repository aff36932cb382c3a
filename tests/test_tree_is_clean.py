"""The committed tree holds no leftovers of runs (a pid file, hypothesis' example database,
caches): they are ignored, and none is tracked. A stray `smg.pid` at the root was once
committed by hand; nothing in the project writes pid files into the tree."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Patterns of run leftovers, matched against each tracked path and each of its folders.
LEFTOVERS = ("*.pid", ".hypothesis", "__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache")


def _git(*args: str) -> str:
    git = shutil.which("git")
    assert git is not None
    return subprocess.run(
        [git, "-C", str(ROOT), *args], check=True, capture_output=True, text=True
    ).stdout


def _tracked() -> list[str]:
    if (ROOT / ".git").exists():
        return _git("ls-files").splitlines()
    # A copy without git (an unpacked source tree, where test runs leave caches): its root's
    # files, where a pid file was once committed.
    return [p.name for p in ROOT.iterdir() if p.is_file()]


def test_no_run_leftovers_are_tracked() -> None:
    stray = [
        path
        for path in _tracked()
        if any(fnmatch.fnmatch(part, pattern) for part in path.split("/") for pattern in LEFTOVERS)
    ]
    assert stray == []


def test_leftovers_are_ignored() -> None:
    ignore = (ROOT / ".gitignore").read_text().splitlines()
    for entry in (".hypothesis/", "*.pid", "__pycache__/", ".pytest_cache/"):
        assert entry in ignore, entry
