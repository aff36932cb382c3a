"""`pagedserve serve` as real processes: the tiny model with SIGTERM mid-stream, and the
demo answer from the default model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.v1 import common_pb2, generation_pb2_grpc
from services.cli.flags import build_parser, engine_args_from, flags_from, subparser
from services.cli.supervisor import wait_until_serving
from tests.services.helpers import gather, request
from tests.services.processes import free_port

ROOT = Path(__file__).resolve().parents[3]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "proto")])
    env.update(extra)
    return env


def test_child_flags_round_trip():
    parser = build_parser()
    argv = ["serve", "--max-num-seqs", "7", "--no-enable-prefix-caching", "--port", "1234"]
    ns = parser.parse_args([*argv, "--pooling-type", "mean"])
    engine_ns = subparser(parser, "engine").parse_args(flags_from(ns, subparser(parser, "engine")))
    assert engine_ns.max_num_seqs == 7 and engine_ns.enable_prefix_caching is False
    assert engine_args_from(engine_ns).pooler_config == {"pooling_type": "MEAN"}
    assert engine_args_from(parser.parse_args(argv)).pooler_config is None
    with pytest.raises(SystemExit):
        parser.parse_args(["engine", "--pooling-type", "max"])
    tokenizer_flags = flags_from(ns, subparser(parser, "tokenizer"))
    assert subparser(parser, "tokenizer").parse_args(tokenizer_flags).port == 1234


def test_cuda_graph_flags_round_trip():
    """`--cuda-graph-sizes` takes a list and reaches the engine child as one."""
    parser = build_parser()
    ns = parser.parse_args(["serve", "--cuda-graph-sizes", "1", "2", "8", "--enforce-eager"])
    engine_ns = subparser(parser, "engine").parse_args(flags_from(ns, subparser(parser, "engine")))
    args = engine_args_from(engine_ns)
    assert args.cuda_graph_sizes == [1, 2, 8] and args.enforce_eager is True
    default = engine_args_from(parser.parse_args(["engine"]))
    assert default.cuda_graph_sizes is None and default.enforce_eager is False


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        ("tokenizer", ["--port", "1234", "--workers", "2", "--max-prompt-tokens", "5"]),
        ("engine", ["--max-num-seqs", "7", "--enforce-eager", "--metrics-port", "9"]),
    ],
)
def test_a_service_alone_parses_as_the_whole_parser(command, argv):
    """`build_parser(command)`, what `pagedserve engine | tokenizer` builds, parses the
    command's flags, prints its help and names every command in its usage line (the one its
    errors print) as the whole parser does."""
    whole, alone = build_parser(), build_parser(command)
    assert vars(alone.parse_args([command, *argv])) == vars(whole.parse_args([command, *argv]))
    assert vars(alone.parse_args([command])) == vars(whole.parse_args([command]))
    assert alone.format_usage() == whole.format_usage()
    assert subparser(alone, command).format_help() == subparser(whole, command).format_help()
    with pytest.raises(KeyError):
        subparser(alone, "generate")
    with pytest.raises(ValueError, match="serve"):
        build_parser("serve")


def test_a_service_alone_imports_no_client_or_gateway_modules():
    code = (
        "import sys; from services.cli.main import build_parser; "
        "build_parser('tokenizer').parse_args(['tokenizer']); "
        "print(sorted(m for m in sys.modules if m.startswith('clients') "
        "or m == 'services.cli.openai_gateway'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_env(), cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_serve_stops_gracefully_on_sigterm(tiny_model_dir):
    port, engine_port = free_port(), free_port()
    env = _env(
        PAGEDSERVE_MODEL=str(tiny_model_dir),
        PAGEDSERVE_PORT=str(port),
        PAGEDSERVE_ENGINE_ADDR=f"127.0.0.1:{engine_port}",
    )
    argv = [sys.executable, "-m", "services", "serve", "--prompt", "", "--shutdown-grace", "1"]
    argv += ["--kv-cache-memory-bytes", str(64 << 20)]
    proc = subprocess.Popen(argv, env=env, cwd=ROOT)
    try:
        assert wait_until_serving(f"127.0.0.1:{port}", [proc], timeout=120)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.TextGenerationServiceStub(channel)
            assert gather(stub.Generate(request(token_ids=[5, 6, 7], max_tokens=3)))[0].token_ids
            stream = stub.Generate(request(token_ids=[5, 6], max_tokens=3000, ignore_eos=True))
            first = next(stream)
            proc.send_signal(signal.SIGTERM)
            # In-flight streams end cleanly: aborted once the grace period runs out.
            rest = gather([first, *stream])[0]
            assert rest.finish_reason == common_pb2.FINISH_REASON_ABORT
        assert proc.wait(30) == 0
        with (
            grpc.insecure_channel(f"127.0.0.1:{engine_port}") as channel,
            pytest.raises(grpc.RpcError),
        ):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_serve_demo_streams_the_default_model_answer():
    port, engine_port = free_port(), free_port()
    argv = [sys.executable, "-m", "services", "serve", "--demo", "--port", str(port)]
    argv += ["--engine-addr", f"127.0.0.1:{engine_port}", "--max-tokens", "32"]
    done = subprocess.run(argv, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "> What is the capital of France?" in done.stdout
    assert "Paris" in done.stdout
    assert "through the public API" in done.stderr
