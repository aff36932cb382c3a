"""The engine sets libgomp's spin count before torch loads it, unless the user set one.

libgomp reads GOMP_SPINCOUNT once, when torch loads it, so the default must be in the
environment before the first `import torch`: importing `engine` puts it there
(benchmarks/offline/noisy_neighbours.py measures why: docs/benchmarks.md "Noisy neighbours")."""

from __future__ import annotations

import os
import subprocess
import sys

CHECK = (
    "import os, sys; import engine; print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
)


def _spin_count_after_import(**env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    environ.update(env)
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, env=environ, check=True
    )
    return done.stdout.split()


def test_the_default_is_set_before_torch_loads() -> None:
    value, torch_loaded = _spin_count_after_import()
    assert value == "10000"
    assert torch_loaded == "False"  # so torch's libgomp will read it when it loads


def test_a_value_the_user_set_wins() -> None:
    assert _spin_count_after_import(GOMP_SPINCOUNT="300000")[0] == "300000"
