"""The `pagedserve` command (also `python -m services`).

    pagedserve serve      both services as child processes (a laptop set-up): waits until
                          they are healthy, streams a demo chat answer through the public
                          API, then serves until Ctrl-C (`--demo`: exits after the answer)
    pagedserve engine     the engine service alone   (default 127.0.0.1:50052)
    pagedserve tokenizer  the tokenizer service alone (default 0.0.0.0:50051, the public API)
    pagedserve gateway    the OpenAI-compatible HTTP API (the smg gateway) in front of engine
                          replicas (`serve --openai-port N` starts it too; services/cli/
                          openai_gateway.py)
    pagedserve generate | chat | tokenize | health | bench serve | bench plot
                          client commands against a running server (clients/cli.py; they
                          never import the engine, so they start fast and need no torch)

Engine flags are `EngineArgs` fields with vLLM's names (`--max-num-seqs`, `--dtype`, ...).
Environment variables give defaults: PAGEDSERVE_MODEL, PAGEDSERVE_HOST, PAGEDSERVE_PORT,
PAGEDSERVE_ENGINE_ADDR, PAGEDSERVE_LOG_LEVEL, PAGEDSERVE_LOG_FORMAT, PAGEDSERVE_METRICS_PORT.
Tracing follows the standard OTEL_* variables (docs/observability.md).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import threading
import typing
from collections.abc import Callable, Sequence
from typing import Any

from clients.cli import CLIENT_COMMANDS, add_client_commands
from clients.cli import main as client_main
from services.cli.openai_gateway import add_gateway_command, add_serve_openai_args
from services.cli.secure_flags import (
    add_security_args,
    engine_link_tls_from,
    request_limits_from,
    server_tls_from,
)
from services.common.metrics import NAME_PREFIX, NAME_PREFIXES

logger = logging.getLogger("services.cli.main")

DEFAULT_PORT = 50051
DEFAULT_ENGINE_ADDR = "127.0.0.1:50052"
DEMO_PROMPT = "What is the capital of France?"
# EngineArgs fields the command sets itself rather than taking as flags.
# `pooler_config` is a dataclass: its `pooling_type` is the `--pooling-type` flag.
_NOT_FLAGS = {"model", "tokenizer", "skip_tokenizer_init", "pooler_config"}
# Help for the flags whose values need more than their default to be understood.
_FLAG_HELP = {
    "cuda_graph_sizes": "decode batch sizes captured in CUDA graphs, e.g. 1 2 4 8; unset: 1, "
    "2, 4, 8, 16, ..., 512 capped by --max-num-seqs; never on CPU",
    "enforce_eager": "run every step eagerly: no CUDA graphs",
    "load_format": "auto (the checkpoint) or dummy (random weights from config.json alone, "
    "for benchmarks)",
    "quantization": "weights kept quantized: auto (a .gguf model on CPU, the default model "
    "included, keeps its GGUF blocks; else none), none (fp32 on CPU), gguf, int8",
    "fairness": "sharing between tenants: vtc (each tenant's share of the batch in "
    "proportion to its API-key-file weight) or off (first come, first served)",
    "fairness_prompt_token_weight": "vtc's cost of a computed prompt token",
    "fairness_output_token_weight": "vtc's cost of a generated token",
}


def _env(name: str, default: Any) -> Any:
    """The variable's value; an empty value counts as unset (compose files often set "")."""
    return os.environ.get(name) or default


# ---- the parser ---------------------------------------------------------------------------


def engine_arg_fields() -> list[dataclasses.Field]:
    from engine import EngineArgs

    return [f for f in dataclasses.fields(EngineArgs) if f.name not in _NOT_FLAGS]


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    from engine.config.engine_config import FairnessPolicy, SchedulingPolicy
    from engine.config.pooler import POOLING_TYPES

    group = parser.add_argument_group("engine (EngineArgs, vLLM's names)")
    for field in engine_arg_fields():
        flag = "--" + field.name.replace("_", "-")
        annotation = str(field.type)
        help_text = f"{_FLAG_HELP.get(field.name, '')} (default: {field.default})".lstrip()
        if "bool" in annotation:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=field.default, help=help_text
            )
        elif annotation.startswith("list[int]"):
            group.add_argument(flag, type=int, nargs="+", default=field.default, help=help_text)
        elif annotation in ("SchedulingPolicy", "FairnessPolicy"):
            literal = SchedulingPolicy if annotation == "SchedulingPolicy" else FairnessPolicy
            choices = typing.get_args(literal)
            group.add_argument(flag, choices=choices, default=field.default, help=help_text)
        else:
            kind = int if "int" in annotation else float if "float" in annotation else str
            group.add_argument(flag, type=kind, default=field.default, help=help_text)
    group.add_argument(
        "--pooling-type",
        type=str.upper,
        choices=POOLING_TYPES,
        default=None,
        help="how Encode pools hidden states: LAST token, MEAN of all prompt tokens, or CLS "
        "(first token); default: the model's sentence-transformers config, else LAST",
    )
    group.add_argument(
        "--max-engine-requests",
        type=int,
        default=1024,
        help="requests in flight at the engine service; more get RESOURCE_EXHAUSTED (1024)",
    )


def _add_fleet_args(parser: argparse.ArgumentParser, command: str) -> None:
    """Streams that survive a replica (docs/deployment.md "What survives what"). The stall
    timeout is one flag both services take: `serve` passes it to both children."""
    group = parser.add_argument_group("replica failures (docs/deployment.md)")
    group.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=10.0,
        help="seconds without progress that make an engine stalled: the engine service "
        "reports NOT_SERVING while a step runs this long, and the tokenizer service moves "
        "the streams of a replica that has sent nothing on any of them this long; 0: never (10)",
    )
    if command in ("serve", "tokenizer"):
        group.add_argument(
            "--migration-limit",
            type=int,
            default=3,
            help="how often one stream may move to another engine replica when the one "
            "holding it dies, stalls or drains; 0: never (the stream ends UNAVAILABLE) (3)",
        )


def _add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=_env("PAGEDSERVE_MODEL", None),
        help="HF directory or .gguf file ($PAGEDSERVE_MODEL; default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--log-level", default=_env("PAGEDSERVE_LOG_LEVEL", "INFO"))
    parser.add_argument(
        "--log-format", choices=("text", "json"), default=_env("PAGEDSERVE_LOG_FORMAT", "text")
    )
    parser.add_argument("--max-message-bytes", type=int, default=16 * 1024 * 1024)
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="seconds in-flight streams get after SIGTERM before they are aborted (tokenizer "
        "service) or handed back for migration (engine service) (10)",
    )
    parser.add_argument(
        "--engine-addr",
        default=_env("PAGEDSERVE_ENGINE_ADDR", DEFAULT_ENGINE_ADDR),
        help=(
            f"the engine service's address ($PAGEDSERVE_ENGINE_ADDR; {DEFAULT_ENGINE_ADDR}); "
            "for `tokenizer`, a comma-separated list of host:port and dns:///name:port "
            "engine replicas"
        ),
    )


def _add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("public API (tokenizer service)")
    group.add_argument("--host", default=_env("PAGEDSERVE_HOST", "0.0.0.0"))
    group.add_argument("--port", type=int, default=int(_env("PAGEDSERVE_PORT", DEFAULT_PORT)))
    group.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="(default: the max_model_len)"
    )
    group.add_argument(
        "--route-policy",
        choices=("affinity", "round_robin"),
        default="affinity",
        help="how requests are spread over engine replicas: prefix affinity bounded by load "
        "(default), or round robin",
    )
    group.add_argument(
        "--max-inflight-requests",
        type=int,
        default=1024,
        help="streams in flight; more get RESOURCE_EXHAUSTED (1024)",
    )


def _add_observability_args(parser: argparse.ArgumentParser, command: str) -> None:
    """`--metrics-port` of each service (0: no endpoint) and the engine's stats log. `serve`
    has one port per child: `--metrics-port` (tokenizer), `--engine-metrics-port` (engine)."""
    group = parser.add_argument_group("observability (docs/observability.md)")
    env_port = _env("PAGEDSERVE_METRICS_PORT", "0")  # a string: argparse applies type=int
    help_port = "Prometheus /metrics on this port ($PAGEDSERVE_METRICS_PORT; 0: off)"
    if command in ("serve", "tokenizer"):
        group.add_argument("--metrics-port", type=int, default=env_port, help=help_port)
    group.add_argument(
        "--metrics-name-prefix",
        choices=NAME_PREFIXES,
        default=_env("PAGEDSERVE_METRICS_NAME_PREFIX", NAME_PREFIX),
        help="the metric names' prefix on /metrics: pagedserve (pagedserve:...) or vllm "
        "(vllm:..., for dashboards and autoscalers made for vLLM) "
        "($PAGEDSERVE_METRICS_NAME_PREFIX; pagedserve)",
    )
    if command in ("serve", "engine"):
        flag = "--engine-metrics-port" if command == "serve" else "--metrics-port"
        default = "0" if command == "serve" else env_port
        group.add_argument(
            flag, dest="engine_metrics_port", type=int, default=default, help=help_port
        )
        group.add_argument(
            "--log-stats-interval",
            type=float,
            default=10.0,
            help="seconds between the engine's stats log lines (10; 0: never)",
        )


def _metrics_address(host: str, port: int) -> str | None:
    return f"{host}:{port}" if port else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="both services as child processes")
    engine = commands.add_parser("engine", help="the engine service")
    tokenizer = commands.add_parser("tokenizer", help="the tokenizer service (public API)")
    for sub in (serve, engine, tokenizer):
        _add_common_args(sub)
    for sub in (serve, engine):
        _add_engine_args(sub)
    for sub in (serve, tokenizer):
        _add_tokenizer_args(sub)
    for name, sub in (("serve", serve), ("engine", engine), ("tokenizer", tokenizer)):
        add_security_args(sub, name)
    for name, sub in (("serve", serve), ("engine", engine), ("tokenizer", tokenizer)):
        _add_observability_args(sub, name)
    for name, sub in (("serve", serve), ("engine", engine), ("tokenizer", tokenizer)):
        _add_fleet_args(sub, name)
    # The children log warnings only, so the demo answer reads cleanly (--log-level INFO
    # shows every request).
    serve.set_defaults(log_level=_env("PAGEDSERVE_LOG_LEVEL", "WARNING"))
    serve.add_argument("--demo", action="store_true", help="exit after the demo answer")
    serve.add_argument("--prompt", default=DEMO_PROMPT, help="the demo question ('' for none)")
    serve.add_argument("--max-tokens", type=int, default=128, help="of the demo answer (128)")
    serve.add_argument(
        "--api-key",
        default=_env("PAGEDSERVE_API_KEY", None),
        help="the demo's key when --api-key-file is given ($PAGEDSERVE_API_KEY)",
    )
    serve.add_argument(
        "--startup-timeout", type=float, default=900.0, help="seconds to wait for health (900)"
    )
    add_serve_openai_args(serve)
    add_gateway_command(commands)
    add_client_commands(commands)
    return parser


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def engine_args_from(ns: argparse.Namespace) -> Any:
    from engine import EngineArgs

    values = {f.name: getattr(ns, f.name) for f in engine_arg_fields()}
    if ns.pooling_type is not None:
        values["pooler_config"] = {"pooling_type": ns.pooling_type}
    # The engine service never sees text.
    return EngineArgs(model=ns.model, skip_tokenizer_init=True, **values)


def flags_from(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """`ns`'s values that `parser` also takes, as flags (for a child process)."""
    argv: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help" or not hasattr(ns, action.dest):
            continue
        value, flag = getattr(ns, action.dest), action.option_strings[0]
        if value is None:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


# ---- the services -------------------------------------------------------------------------


def _load_in_daemon_thread(load: Callable[[], Any]) -> asyncio.Future[Any]:
    """Runs `load` in a daemon thread (a signal during loading need not wait for it)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        try:
            result = load()
        except BaseException as exc:
            loop.call_soon_threadsafe(future.set_exception, exc)
        else:
            loop.call_soon_threadsafe(future.set_result, result)

    threading.Thread(target=run, name="pagedserve-load", daemon=True).start()
    return future


async def run_engine(ns: argparse.Namespace) -> int:
    from engine import AsyncLLMEngine
    from services.common.grpc_server import on_sighup, wait_for_signal
    from services.common.tracing import ENGINE_SERVICE_NAME, setup_tracing
    from services.engine_service.server import EngineServer, EngineServerConfig

    engine_args = engine_args_from(ns)  # bad flags fail before anything starts
    setup_tracing(ENGINE_SERVICE_NAME)  # flushed at exit by the provider itself
    server = EngineServer(
        EngineServerConfig(
            address=ns.engine_addr,
            max_inflight_requests=ns.max_engine_requests,
            max_message_bytes=ns.max_message_bytes,
            shutdown_grace_s=ns.shutdown_grace,
            engine_stall_timeout_s=ns.engine_stall_timeout,
            metrics_address=_metrics_address(
                ns.engine_addr.rpartition(":")[0], ns.engine_metrics_port
            ),
            metrics_name_prefix=ns.metrics_name_prefix,
            log_stats_interval_s=ns.log_stats_interval,
            tls=server_tls_from(ns),
            allow_insecure=ns.allow_insecure_engine,
        )
    )
    try:
        await server.start()
    except OSError as exc:  # the port is in use, or the address cannot be bound
        logger.error("cannot start the engine service: %s", exc)
        return 1
    on_sighup(server.reload)
    stop = asyncio.ensure_future(wait_for_signal())
    load = _load_in_daemon_thread(lambda: AsyncLLMEngine.from_engine_args(engine_args))
    await asyncio.wait({stop, load}, return_when=asyncio.FIRST_COMPLETED)
    engine = None
    if load.done() and load.exception() is not None:
        logger.error("could not start the engine: %s", load.exception())
        await server.stop(0)
        return 1
    if load.done():
        engine = load.result()
        await server.attach_engine(engine)
        dead = asyncio.ensure_future(server.engine_dead.wait())
        await asyncio.wait({stop, dead}, return_when=asyncio.FIRST_COMPLETED)
    await server.stop()
    if engine is not None:
        await asyncio.to_thread(engine.shutdown)
    return 1 if engine is not None and engine.errored and not stop.done() else 0


async def run_tokenizer(ns: argparse.Namespace) -> int:
    from services.tokenizer_service.model_files import needs_torch
    from services.tokenizer_service.torch_free import hide_torch

    if not needs_torch(ns.model):  # before anything imports transformers
        hide_torch()
    from services.common.grpc_server import on_sighup, wait_for_signal
    from services.common.tracing import TOKENIZER_SERVICE_NAME, setup_tracing
    from services.tokenizer_service.model_files import load_text_model_files
    from services.tokenizer_service.server import TokenizerServer, TokenizerServerConfig

    setup_tracing(TOKENIZER_SERVICE_NAME)  # flushed at exit by the provider itself
    files = await asyncio.to_thread(load_text_model_files, ns.model)
    server = TokenizerServer(
        TokenizerServerConfig(
            address=f"{ns.host}:{ns.port}",
            engine_address=ns.engine_addr,
            max_inflight_requests=ns.max_inflight_requests,
            max_prompt_tokens=ns.max_prompt_tokens,
            max_message_bytes=ns.max_message_bytes,
            shutdown_grace_s=ns.shutdown_grace,
            metrics_address=_metrics_address(ns.host, ns.metrics_port),
            metrics_name_prefix=ns.metrics_name_prefix,
            route_policy=ns.route_policy,
            migration_limit=ns.migration_limit,
            engine_stall_timeout_s=ns.engine_stall_timeout,
            tls=server_tls_from(ns),
            engine_tls=engine_link_tls_from(ns),
            api_key_file=ns.api_key_file,
            limits=request_limits_from(ns),
        ),
        files,
    )
    await server.start()
    on_sighup(server.reload)
    await wait_for_signal()
    await server.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from services.common.log import setup_logging

    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in CLIENT_COMMANDS:  # their own parser: no engine (torch) import
        return client_main(args)
    parser = build_parser()
    ns = parser.parse_args(argv)
    setup_logging(ns.log_level, ns.log_format)
    if ns.command == "serve":
        from services.cli.supervisor import serve

        return serve(ns, parser)
    if ns.command == "gateway":
        from services.cli.openai_gateway import run_gateway

        return run_gateway(ns)
    from services.common.errors import ConfigError

    runner = run_engine if ns.command == "engine" else run_tokenizer
    try:
        return asyncio.run(runner(ns))
    except ConfigError as exc:  # a bad TLS / key file or an insecure bind: one line, no trace
        logger.error("cannot start: %s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
