"""Triton in the tests: a dependency on Linux x86_64 (pyproject.toml), where its absence is
a broken install and fails the test; elsewhere it is not installed, and the Triton tests
skip. The kernels run under Triton's interpreter on a CPU (tests/conftest.py)."""

from __future__ import annotations

import platform
import sys
from types import ModuleType

import pytest

# pyproject.toml: triton; platform_system == 'Linux' and platform_machine == 'x86_64'
TRITON_REQUIRED = sys.platform.startswith("linux") and platform.machine() == "x86_64"


def import_triton() -> ModuleType:
    if not TRITON_REQUIRED:
        return pytest.importorskip("triton", reason="triton is a dependency on Linux x86_64 only")
    import triton

    return triton
