"""Engine services as real processes on loopback ports, for the scale-out tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

from services.cli.supervisor import wait_until_serving
from tests.services import engine_zygote
from tests.services.engine_zygote import ForkedProcess

ROOT = Path(__file__).resolve().parents[2]
KV_CACHE_BYTES = 16 << 20  # ~2k blocks of the tiny model: plenty, and cheap


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_processes(pid: int) -> list[psutil.Process]:
    """The tensor/pipeline-parallel ranks under the engine process `pid`: spawned ones
    (`spawn_main`), or the children of its rank forkserver (engine/executor/rank_forkserver.py),
    which the server's own command line names."""
    ranks = []
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            parent = child.parent()
            if "spawn_main" in " ".join(child.cmdline()) or (
                parent is not None and "multiprocessing.forkserver" in " ".join(parent.cmdline())
            ):
                ranks.append(child)
    return ranks


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "proto")])
    env.update(extra)
    return env


class EngineProcess:
    """`pagedserve engine` on `127.0.0.1:port` (a free port unless given)."""

    def __init__(
        self,
        model_dir: Path,
        port: int | None = None,
        *extra_args: str,
        host: str = "127.0.0.1",
        metrics_port: int | None = None,
        env: dict[str, str] | None = None,
        forked: bool = False,
    ) -> None:
        """`forked`: started from the session's engine zygote (tests/services/
        engine_zygote.py), without the ~7 s of imports a fresh interpreter pays."""
        self.model_dir = model_dir
        self.env = env or {}  # added to the process's environment
        self.host = host
        self.port = port or free_port()
        self.extra_args = extra_args
        self.metrics_port = metrics_port
        self.forked = forked
        self.proc: subprocess.Popen | ForkedProcess | None = None

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def metrics(self) -> dict[str, float]:
        """The engine's /metrics samples, by name (labels dropped: one model per engine)."""
        assert self.metrics_port is not None
        host = f"[{self.host}]" if ":" in self.host else self.host
        url = f"http://{host}:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
        return samples

    def start(self) -> EngineProcess:
        args = ["engine", "--model", str(self.model_dir), "--engine-addr", self.address]
        args += ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
        args += ["--log-level", "WARNING", *self.extra_args]
        if self.metrics_port is not None:
            args += ["--metrics-port", str(self.metrics_port)]
        if self.forked:
            env = child_env(**self.env)
            self.proc = engine_zygote.start(args, env, str(ROOT), base_env=child_env())
        else:
            argv = [sys.executable, "-m", "services", *args]
            self.proc = subprocess.Popen(argv, env=child_env(**self.env), cwd=ROOT)
        return self

    def wait_serving(self, timeout: float = 120.0) -> None:
        assert self.proc is not None
        assert wait_until_serving(self.address, [self.proc], timeout), f"{self.address} down"

    def kill(self) -> None:
        """SIGKILL: no goodbye to anyone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
