"""`pagedserve tokenizer --workers 2` as real processes (services/cli/tokenizer_workers.py):
both workers take connections on the one port, /metrics reports each, SIGHUP reloads the API
keys in every worker, SIGTERM stops them all, and a worker that dies takes the group down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.v1 import generation_pb2_grpc
from services.cli.supervisor import wait_until_serving
from tests.services.helpers import gather, request, wait_for
from tests.services.processes import ROOT, child_env, free_port

OLD_KEY = "old-key-0123456789abcdef00"
NEW_KEY = "new-key-0123456789abcdef00"

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="SO_REUSEPORT spreading and /proc are Linux's"
)


def _children(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


def _generate_codes(port: int, key: str, num_connections: int) -> list[grpc.StatusCode]:
    """One Generate on each of `num_connections` fresh connections (the kernel picks the
    worker per connection)."""
    codes = []
    for _ in range(num_connections):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.TextGenerationServiceStub(channel)
            try:
                out = gather(
                    stub.Generate(
                        request(token_ids=[5, 6, 7], max_tokens=2, ignore_eos=True),
                        metadata=[("authorization", f"Bearer {key}")],
                        timeout=60,
                    )
                )
                assert len(out[0].token_ids) == 2
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
    return codes


def _generate_counts(metrics_port: int) -> dict[str, float]:
    """Generate calls by worker, from the group's /metrics."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pagedserve:rpc_requests_total" and sample.labels.get(
                "method", ""
            ).endswith("Generate"):
                worker = sample.labels["worker"]
                counts[worker] = counts.get(worker, 0.0) + sample.value
    return counts


def _workers_reporting(metrics_port: int) -> set[str]:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        s.labels["worker"]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "worker" in s.labels
    }


def _start(stack, model_dir: Path, key_file: Path, port: int, metrics_port: int):
    argv = [sys.executable, "-m", "services", "tokenizer", "--workers", "2"]
    argv += ["--model", str(model_dir), "--engine-addr", f"127.0.0.1:{stack.engine_port}"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port)]
    argv += ["--api-key-file", str(key_file), "--log-level", "WARNING"]
    return subprocess.Popen(argv, env=child_env(), cwd=ROOT)


def test_two_workers_share_the_port_metrics_and_key_reloads(stack, tiny_model_dir, tmp_path):
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"{OLD_KEY} alice\n")
    port, metrics_port = free_port(), free_port()
    group = _start(stack, tiny_model_dir, key_file, port, metrics_port)
    try:
        assert wait_until_serving(f"127.0.0.1:{port}", [group], 180)
        workers = _children(group.pid)
        assert len(workers) == 2
        wait_for(lambda: _workers_reporting(metrics_port) == {"0", "1"}, timeout=120)

        assert _generate_codes(port, OLD_KEY, 16) == [grpc.StatusCode.OK] * 16
        counts = _generate_counts(metrics_port)
        assert set(counts) == {"0", "1"} and all(v > 0 for v in counts.values()), counts
        assert sum(counts.values()) == 16

        # A new key file, then SIGHUP to the group: every worker takes the new keys.
        key_file.write_text(f"{NEW_KEY} alice\n")
        group.send_signal(signal.SIGHUP)
        wait_for(
            lambda: set(_generate_codes(port, OLD_KEY, 4)) == {grpc.StatusCode.UNAUTHENTICATED}
        )
        assert _generate_codes(port, NEW_KEY, 12) == [grpc.StatusCode.OK] * 12
        assert _generate_codes(port, OLD_KEY, 12) == [grpc.StatusCode.UNAUTHENTICATED] * 12
        counts_after = _generate_counts(metrics_port)
        assert all(counts_after[w] > counts[w] for w in ("0", "1")), counts_after

        group.send_signal(signal.SIGTERM)
        assert group.wait(60) == 0
        assert all(not Path(f"/proc/{pid}").exists() for pid in workers)
    finally:
        if group.poll() is None:
            group.kill()
            group.wait(30)
    stack.wait_until_idle()


def test_a_worker_that_dies_stops_the_group(stack, tiny_model_dir, tmp_path):
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"{OLD_KEY} alice\n")
    port, metrics_port = free_port(), free_port()
    group = _start(stack, tiny_model_dir, key_file, port, metrics_port)
    try:
        assert wait_until_serving(f"127.0.0.1:{port}", [group], 180)
        workers = wait_for(lambda: len(_children(group.pid)) == 2 and _children(group.pid))
        os.kill(workers[0], signal.SIGKILL)
        assert group.wait(60) != 0
        assert not Path(f"/proc/{workers[1]}").exists()  # stopped and reaped by the group
    finally:
        if group.poll() is None:
            group.kill()
            group.wait(30)


def test_workers_refuse_port_zero(stack, tiny_model_dir):
    argv = [sys.executable, "-m", "services", "tokenizer", "--workers", "2", "--port", "0"]
    argv += ["--model", str(tiny_model_dir), "--engine-addr", f"127.0.0.1:{stack.engine_port}"]
    done = subprocess.run(
        argv, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "--port" in done.stderr
