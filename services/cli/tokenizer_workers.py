"""`pagedserve tokenizer --workers N`: N tokenizer service processes on one port, so the
tier uses more than one core (one Python process detokenizes on one core at most).

    pagedserve tokenizer --workers 4 --port 50051 --metrics-port 9100
        │ (this process: starts, watches and signals the workers; serves the metrics)
        ├─▶ worker 0 ─┐  each a whole tokenizer service with its own engine connections,
        ├─▶ worker 1  ├─ bound to :50051 with SO_REUSEPORT: the kernel spreads incoming
        └─▶ ...      ─┘  connections over them
              ▲ /metrics on a private loopback port each; :9100 serves them all, each sample
                labelled worker="i"

- Health: every worker answers it for itself, so any connection gets a true answer.
- SIGHUP (certificate and API key reload) is passed on to every worker; SIGTERM / SIGINT
  too, and this process exits once they have (each drains as a single service does).
- A worker that exits stops the others: this process then exits with its status, for the
  process manager to restart the whole group (a half-sized group would look healthy).

A worker is the same command line run again with `WORKER_ENV` set ("index:metrics port");
it then ignores `--workers`, shares its port, and serves its metrics on loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger("services.cli.tokenizer_workers")

WORKER_ENV = "PAGEDSERVE_TOKENIZER_WORKER"


def default_workers() -> int:
    """Half the cores this process may run on (at least 1): the other half is left to the
    engine service and the clients that share the host in the usual single-node set-up."""
    if hasattr(os, "sched_getaffinity"):
        num_cores = len(os.sched_getaffinity(0))
    else:  # macOS: no affinity call
        num_cores = os.cpu_count() or 1
    return max(1, num_cores // 2)


def worker_identity() -> tuple[int, int] | None:
    """(index, metrics port; 0: none) when this process is a worker, else None."""
    value = os.environ.get(WORKER_ENV)
    if not value:
        return None
    index, _, port = value.partition(":")
    return int(index), int(port or 0)


class WorkerMetrics:
    """A collector: every worker's /metrics, read at scrape time, each sample labelled
    with its worker's index (a worker that does not answer is left out of that scrape)."""

    def __init__(self, ports: Sequence[int]) -> None:
        self.ports = list(ports)

    def collect(self) -> Iterable[Any]:
        families: dict[str, Metric] = {}
        for index, port in enumerate(self.ports):
            try:
                url = f"http://127.0.0.1:{port}/metrics"
                with urllib.request.urlopen(url, timeout=5) as reply:
                    text = reply.read().decode()
            except OSError:
                continue
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                merged.samples += [
                    s._replace(labels={**s.labels, "worker": str(index)}) for s in family.samples
                ]
        yield from families.values()


def _free_loopback_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In a worker: SIGTERM when this process dies, however it dies (no orphan)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_workers(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    """Starts `ns.workers` workers running `argv` (this command line) and supervises them
    until a signal or a worker's exit; returns the exit status."""
    from services.common.metrics import MetricsEndpoint

    if ns.port == 0:
        logger.error("--workers needs a fixed --port: port 0 would give each worker its own")
        return 2
    metrics_ports = [_free_loopback_port() if ns.metrics_port else 0 for _ in range(ns.workers)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "services", *argv],
            env={**os.environ, WORKER_ENV: f"{index}:{port}"},
            preexec_fn=_die_with_parent,
        )
        for index, port in enumerate(metrics_ports)
    ]
    logger.info("tokenizer workers started", extra={"pids": ",".join(str(p.pid) for p in procs)})
    endpoint = None
    if ns.metrics_port:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(WorkerMetrics(metrics_ports))  # type: ignore[arg-type]
        endpoint = MetricsEndpoint(registry, f"{ns.host}:{ns.metrics_port}", ns.metrics_name_prefix)
        endpoint.start()
    stop = threading.Event()

    def forward(sig: int, _frame: Any) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(sig)
        if sig != signal.SIGHUP:
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    exited = None
    while not stop.wait(0.2):
        exited = next((p for p in procs if p.poll() is not None), None)
        if exited is not None:
            logger.error(
                "a tokenizer worker exited; stopping the others",
                extra={"pid": exited.pid, "code": exited.returncode},
            )
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            break
    codes = [proc.wait() for proc in procs]
    if endpoint is not None:
        asyncio.run(endpoint.stop())
    if exited is not None:
        return exited.returncode or 1
    return max((c for c in codes if c > 0), default=0)
