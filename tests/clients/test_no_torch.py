"""The client library installs without torch: importing it (and its CLI, and the `pagedserve`
command's client path) loads neither torch nor `engine`; `clients` never imports
`services`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import sys
{imports}
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {{"torch", "engine", "transformers"}})
assert not loaded, loaded
{extra}
print("ok")
"""


def _run(imports: str, extra: str = "") -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "proto")]))
    code = CHECK.format(imports=imports, extra=extra)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_importing_the_clients_loads_no_torch():
    _run(
        "import clients, clients.cli, clients.bench, clients.bench_plot, clients.chat\n"
        "from clients import Client, AsyncClient",
        # clients/ never imports services/ (the layering rule)
        extra="assert not [m for m in sys.modules if m.split('.')[0] == 'services']",
    )


def test_the_client_commands_of_pagedserve_load_no_torch():
    # `pagedserve health` against nothing: fails fast, without building the server parser.
    _run(
        "from services.cli.main import main\n"
        "assert main(['health', '--address', '127.0.0.1:1', '--timeout', '1']) == 1"
    )
