"""The layer rules are import-linter contracts (.importlinter), checked here so that `make test`
fails on a broken one: the tokenizer tier imports only engine.api of the engine, the services'
processes never import each other, the engine never imports the services, and so on.

import-linter follows imports inside functions too, so a lazy import that would load the
engine's torch side in the tokenizer service breaks a contract as a top-level one would.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / ".importlinter"

# Per contract, the parts of engine/ it does not forbid; every other part must be listed.
ALLOWED_ENGINE_PARTS = {
    "tokenizer-tier": {"engine.api"},
    "command": {"engine.api", "engine.config"},
    "api": {"engine.api"},
    "config": {"engine.api", "engine.config", "engine.pooling_params"},
    "core": {"engine.api", "engine.config", "engine.core", "engine.pooling_params"},
}


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` over the packages under `root` (proto/ holds the generated package)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "proto")]))
    command = "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"
    return subprocess.run(
        [sys.executable, "-c", command, "--config", str(CONFIG), "--no-cache", "--no-logo"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _engine_parts() -> set[str]:
    parts = set()
    for path in (ROOT / "engine").iterdir():
        if path.name.startswith(("_", ".")) and path.name != "__main__.py":
            continue
        if path.suffix == ".py" or (path / "__init__.py").is_file():
            parts.add(f"engine.{path.stem}")
    return parts


def test_the_import_contracts_are_kept() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_contracts_name_every_part_of_the_engine() -> None:
    """A new engine subpackage is forbidden to the tokenizer tier (and the others) only once
    it is listed: a missing one would pass silently."""
    config = configparser.ConfigParser()
    config.read(CONFIG)
    engine_parts = _engine_parts()
    assert {"engine.api", "engine.core", "engine.worker"} <= engine_parts
    for contract, allowed in ALLOWED_ENGINE_PARTS.items():
        forbidden = set(config[f"importlinter:contract:{contract}"]["forbidden_modules"].split())
        assert engine_parts - allowed == {m for m in forbidden if m.split(".")[0] == "engine"}, (
            contract
        )


def test_a_lazy_import_of_the_engine_in_the_tokenizer_service_breaks_a_contract(
    tmp_path: Path,
) -> None:
    """On a copy of the tree: an import inside a function is seen, and reported by name."""
    for package in ("engine", "services", "clients", "kernels", "proto/pagedserve"):
        shutil.copytree(
            ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    routing = tmp_path / "services/tokenizer_service/replicas/routing.py"
    routing.write_text(
        routing.read_text()
        + "\n\ndef _lazy():\n    from engine.core.block_pool import BlockPool\n\n"
        + "    return BlockPool\n"
    )
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "The tokenizer tier imports only engine.api of the engine" in result.stdout
    assert "services.tokenizer_service.replicas.routing -> engine.core.block_pool" in result.stdout
