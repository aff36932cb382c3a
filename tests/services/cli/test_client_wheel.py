"""The `pagedserve-client` wheel installs on its own: built from this repository
(scripts/build_client_wheel.py), installed into a fresh virtual environment that has no
torch, it calls a real server (library and command)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import venv
import zipfile

import pytest

from tests.services.secure import ROOT

CALL = """
import importlib.util, sys
from clients import Client
assert importlib.util.find_spec("torch") is None, "torch in the client's environment"
assert importlib.util.find_spec("services") is None and importlib.util.find_spec("engine") is None
with Client(sys.argv[1], timeout=30) as client:
    result = client.generate_text(token_ids=[5, 6, 7], max_tokens=3, temperature=0)
    assert len(result.outputs[0].token_ids) == 3, result
    print(client.tokenize("hello world").count)
"""


# The fresh environment's own view: a PYTHONPATH naming this checkout (as a developer may
# set) would put `services` and `engine` back in reach of the installed client.
_WITHOUT_CHECKOUT = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _build(tmp_path) -> str:
    spec = importlib.util.spec_from_file_location(
        "build_client_wheel", ROOT / "scripts" / "build_client_wheel.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.build(tmp_path / "dist"))


def test_the_client_wheel_installs_without_torch_and_calls_a_server(stack, tmp_path):
    wheel = _build(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "clients/client.py" in names and "pagedserve/v1/generation_pb2.py" in names
    assert not [n for n in names if n.split("/")[0] in ("services", "engine", "kernels")]
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [
        line.split(";")[0].strip()
        for line in zipfile.ZipFile(wheel).read(metadata).decode().splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert sorted(re.split(r"[<>=!~ ]", r.split(":")[1].strip())[0] for r in requires) == [
        "grpcio",
        "protobuf",
    ]
    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = str(env_dir / "bin" / "python")
    # This environment's pip installs into the fresh one (its index settings and cache).
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", wheel],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if install.returncode != 0 and "No matching distribution" in install.stderr:
        pytest.skip(f"grpcio / protobuf cannot be installed here: {install.stderr[-300:]}")
    assert install.returncode == 0, install.stderr[-2000:]
    address = f"127.0.0.1:{stack.public_port}"
    done = subprocess.run(
        [python, "-c", CALL, address],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=_WITHOUT_CHECKOUT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.strip()) > 0
    command = env_dir / "bin" / "pagedserve-client"
    done = subprocess.run(
        [str(command), "tokenize", "hello", "--address", address],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=_WITHOUT_CHECKOUT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "hello" in done.stdout
