"""The client subcommands of `pagedserve`: as processes against the in-process services
(`python -m services generate ...`), and `chat`'s history against the fake server."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from clients import Client
from clients.cli import add_client_commands, run_chat
from tests.clients.fake_server import FakeService, start_fake_server
from tests.services.processes import free_port

ROOT = Path(__file__).resolve().parents[2]


def pagedserve(*argv: str, stdin: str | None = None, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "proto")]))
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "services", *argv],
        cwd=ROOT,
        env=environ,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_generate_streams_the_answer(address):
    proc = pagedserve(
        "generate", "The capital of France is", "--address", address,
        "--max-tokens", "6", "--temperature", "0",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    with Client(address) as client:
        expected = client.generate_text("The capital of France is", max_tokens=6, temperature=0)
    assert proc.stdout == expected.text + "\n"
    assert "[6 tokens in" in proc.stderr and "finish_reason=length" in proc.stderr


def test_generate_reports_a_bad_request(address):
    proc = pagedserve("generate", "hi", "--top-p", "0", "--address", address)
    assert proc.returncode == 1
    assert "INVALID_ARGUMENT" in proc.stderr and "sampling_params.top_p" in proc.stderr


def test_tokenize_and_health_with_the_address_from_the_environment(address):
    proc = pagedserve("tokenize", "Hello world", PAGEDSERVE_ADDRESS=address)
    assert proc.returncode == 0, proc.stderr
    assert "token_ids: [19556, 905]" in proc.stdout and "'Ġworld'" in proc.stdout
    assert "count: 2" in proc.stdout

    proc = pagedserve("health", PAGEDSERVE_ADDRESS=address)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("SERVING") and "engine_reachable: true" in proc.stdout


def test_health_fails_when_nothing_listens():
    proc = pagedserve("health", "--address", f"127.0.0.1:{free_port()}", "--timeout", "2")
    assert proc.returncode == 1 and "UNAVAILABLE" in proc.stderr


def test_health_wait_asks_until_a_late_server_is_serving():
    """`health --wait`: a script starts a server in the background and waits on this. The
    server comes up only after the command is running (its first calls find nothing)."""
    port = free_port()
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "proto")]))
    argv = [sys.executable, "-m", "services", "health", "--address", f"127.0.0.1:{port}"]
    proc = subprocess.Popen(
        [*argv, "--wait", "300", "--timeout", "2"],
        cwd=ROOT,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    server = None
    try:
        # Not yet: nothing listens until the command has made at least one call.
        assert pagedserve("health", "--address", f"127.0.0.1:{port}").returncode == 1
        assert proc.poll() is None
        server, _ = start_fake_server(FakeService(), port)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert out.startswith("SERVING")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if server is not None:
            server.stop(None)
    proc = pagedserve("health", "--address", f"127.0.0.1:{free_port()}", "--wait", "1")
    assert proc.returncode == 1 and "UNAVAILABLE" in proc.stderr


def test_bench_serve_saves_its_result(address, stack, tmp_path):
    proc = pagedserve(
        "bench", "serve", "--address", address, "--num-prompts", "4",
        "--random-input-len", "6", "--random-output-len", "3", "--max-concurrency", "2",
        "--save-result", "--result-dir", str(tmp_path), "--disable-tqdm",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "Mean ITL (ms):" in proc.stdout
    [saved] = list(tmp_path.glob("bench-serve-infqps-concurrency2-*.json"))
    result = json.loads(saved.read_text())
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (4, 0, 12)
    stack.wait_until_idle()


def test_chat_reads_turns_from_stdin(address):
    argv = ["chat", "--address", address, "--max-tokens", "4", "--temperature", "0"]
    proc = pagedserve(*argv, stdin="Hi!\nWho are you?\n")  # EOF ends the chat
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) >= 2  # one answer per turn


def test_chat_keeps_the_history(capsys):
    service = FakeService()
    server, port = start_fake_server(service)
    parser = argparse.ArgumentParser()
    add_client_commands(parser.add_subparsers(dest="command"))
    argv = ["chat", "--address", f"127.0.0.1:{port}", "--system", "Be brief.", "--max-tokens", "3"]
    try:
        ns = parser.parse_args(argv)
        assert (
            run_chat(ns, stdin=io.StringIO("Hi!\n\nAnd then?\n/reset\nAgain\n/exit\nlost\n")) == 0
        )
    finally:
        server.stop(0)
    assert capsys.readouterr().out == "t7t8t9\n" * 3
    turns = [[(m.role, m.content) for m in r.chat.messages] for r in service.requests]
    system = ("system", "Be brief.")
    assert turns == [
        [system, ("user", "Hi!")],
        [system, ("user", "Hi!"), ("assistant", "t7t8t9"), ("user", "And then?")],
        [system, ("user", "Again")],  # after /reset
    ]
    assert all(r.sampling_params.max_tokens == 3 for r in service.requests)
