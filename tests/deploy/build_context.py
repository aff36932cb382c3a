"""What the images' build context holds: `.dockerignore` read with Docker's rules.

The images run `pip install .` on this context, and the wheel test builds its wheel from the
same files, so a file the package needs but the context leaves out fails both the same way.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

Rules = list[tuple[bool, re.Pattern[str]]]


def dockerignore_rules() -> Rules:
    """.dockerignore as (re-include?, pattern): Docker's rules for the patterns used here
    (`*` within one path segment, `**` across segments, the last matching line wins)."""
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = line.lstrip("!").strip().strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        regex = re.sub(r"\\\[(.*?)\\\]", r"[\1]", regex)
        rules.append((include, re.compile(regex + r"\Z")))
    return rules


def in_build_context(path: str, rules: Rules) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    kept = True
    for include, pattern in rules:
        if any(pattern.match(prefix) for prefix in prefixes):
            kept = include
    return kept


def build_context_files() -> list[str]:
    """Every file of the checkout that `docker build .` sends (hidden folders such as .git
    and .venv are never part of it, so they are not walked)."""
    rules = dockerignore_rules()
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in names:
            relative = (Path(folder) / name).relative_to(ROOT).as_posix()
            if in_build_context(relative, rules):
                files.append(relative)
    return sorted(files)


def copy_build_context(target: Path) -> Path:
    """The build context as a folder of its own: what `pip install .` sees in the image."""
    for relative in build_context_files():
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / relative, target / relative)
    return target
