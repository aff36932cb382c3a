"""The tokenizer service never loads torch: its modules and engine.api (all it imports of the
engine, .importlinter) import none, and a real tokenizer service process that has served
Generate, Tokenize and Encode has no libtorch mapped and a small peak RSS (DESIGN.md: the
tokenizer service is the tier that scales out). Its tokenizer is the light one (no
transformers: tests/services/tokenizer_service/test_light_tokenizer.py checks the imports),
as its log says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clients import Client
from services.cli.supervisor import wait_until_serving
from tests.services.processes import ROOT, EngineProcess, child_env, free_port

# The budget for the tier with the light tokenizer (about 90 MiB measured; transformers'
# tokenizer costs about 140 MiB: docs/benchmarks.md).
MAX_PEAK_RSS_MIB = 120

IMPORT_ALL = """
import importlib, pkgutil, sys
import engine.api, services.tokenizer_service, services.common, services.security
import services.cli.main
for package in (engine.api, services.tokenizer_service, services.common, services.security):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
from engine.api.errors import EngineDeadError
from engine import EngineDeadError as same
assert same is EngineDeadError
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
assert not loaded, loaded[:5]
print("ok")
"""


def test_the_tokenizer_service_modules_import_no_torch():
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_serving_tokenizer_process_maps_no_torch(tiny_model_dir: Path, tmp_path: Path):
    engine = EngineProcess(tiny_model_dir).start()
    log = (tmp_path / "tokenizer.log").open("w")
    port = free_port()
    tokenizer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services",
            "tokenizer",
            "--model",
            str(tiny_model_dir),
            "--engine-addr",
            engine.address,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "INFO",
        ],
        env=child_env(),
        cwd=ROOT,
        stderr=log,
    )
    try:
        engine.wait_serving()
        address = f"127.0.0.1:{port}"
        assert wait_until_serving(address, [tokenizer], 120), "tokenizer service down"
        with Client(address, timeout=60) as client:
            result = client.generate_text("hello there", max_tokens=8, temperature=0)
            assert result.usage.completion_tokens == 8
            assert client.tokenize("hello there").token_ids
            assert client.encode("hello there")[0]  # pooled through the engine
        maps = Path(f"/proc/{tokenizer.pid}/maps").read_text()
        assert "libtorch" not in maps
        assert _peak_rss_mib(tokenizer.pid) <= MAX_PEAK_RSS_MIB
    finally:
        tokenizer.terminate()
        tokenizer.wait(30)
        log.close()
        engine.stop()
    lines = (tmp_path / "tokenizer.log").read_text().splitlines()
    assert [line for line in lines if "tokenizer: " in line and "tokenizers + jinja2" in line]
    assert not [line for line in lines if "tokenizer: transformers" in line]
