"""The flags of the server commands (`pagedserve serve | engine | tokenizer`): the parser.

`build_parser()` adds the client commands' parsers (clients/cli.py), the security flags
(secure_flags.py) and the gateway's (openai_gateway.py) to these (`build_parser("engine")`
or `("tokenizer")`: that command's parser alone, so a service started alone does not import
the client and gateway modules); engine flags are
`EngineArgs` fields with vLLM's names. `flags_from` turns parsed values back into flags, so
`serve` (supervisor.py) passes its children the flags they take. Apart from the command
(main.py, which runs the services) because tests, the compose checks and the supervisor
build and read the parser without starting anything; nothing here imports torch at import
time (the engine's modules are imported inside the functions that need them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from collections.abc import Callable
from typing import Any

from services.cli.secure_flags import add_security_args
from services.common.metrics import NAME_PREFIX, NAME_PREFIXES

DESCRIPTION = "The `pagedserve` command (also `python -m services`)."
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
    "served_model_name": "the model's names in the API, e.g. SmolLM2-135M-Instruct (one or "
    "more; the first is reported, e.g. as the OpenAI door's model id); unset: --model as given, "
    "else the model directory's name",
    "load_format": "auto (the checkpoint) or dummy (random weights from config.json alone, "
    "for benchmarks)",
    "quantization": "weights kept quantized: auto (a .gguf model on CPU, the default model "
    "included, keeps its GGUF blocks; an AWQ / GPTQ checkpoint its INT4 weights; else none), "
    "none (fp32 on CPU), gguf, int8, awq, gptq (a checkpoint's own method)",
    "fairness": "sharing between tenants: vtc (each tenant's share of the batch in "
    "proportion to its API-key-file weight) or off (first come, first served)",
    "fairness_prompt_token_weight": "vtc's cost of a computed prompt token",
    "fairness_output_token_weight": "vtc's cost of a generated token",
    "async_scheduling": "the host schedules and prepares step N+1 while step N runs on the "
    "device; same tokens; steps that need their tokens on the host first (structured outputs, "
    "n-gram drafts, penalties) run synchronously; off with pipeline parallelism or rank "
    "processes (docs/engine.md)",
    "batch_invariant": "a request's tokens and logprobs bitwise the same whatever else is "
    "in the batch (chunking, prefix hits, preemption, migration included); CPU, float32; "
    "costs throughput (docs/determinism.md)",
}


def _positive_int(flag: str) -> Callable[[str], int]:
    """An argparse type: an integer of at least 1, the flag named when not."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be at least 1, got {value}")
        return value

    return parse


def _env(name: str, default: Any) -> Any:
    """The variable's value; an empty value counts as unset (compose files often set "")."""
    return os.environ.get(name) or default


# ---- the parser ---------------------------------------------------------------------------


def json_object(text: str) -> dict[str, Any]:
    """A dict-typed field's flag value: a JSON object, as vLLM's flags take them
    (`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`). argparse
    puts the flag's name before the message of the error raised here."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ({{...}}), got {text!r}")
    return value


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
        elif annotation.startswith("dict"):
            group.add_argument(flag, type=json_object, default=field.default, help=help_text)
        elif annotation.startswith("list[int]"):
            group.add_argument(flag, type=int, nargs="+", default=field.default, help=help_text)
        elif annotation.startswith("list[str]"):
            group.add_argument(flag, nargs="+", default=field.default, help=help_text)
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
    group.add_argument(
        "--engine-per-request-calls",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="one Generate call per request to the engine, instead of every request over "
        "one multiplexed GenerateStream call per engine connection (the default, where the "
        "engine serves it; docs/grpc.md)",
    )
    group.add_argument(
        "--stream-interval",
        type=_positive_int("--stream-interval"),
        default=1,
        help="tokens per streamed message while an output's tokens keep coming: 1 (default) "
        "sends each token as it comes; N holds them until N have come or the output ends "
        "(the first token is never held): fewer messages per token for the tokenizer service "
        "and the client, text in steps of N",
    )


def _add_workers_arg(tokenizer: argparse.ArgumentParser) -> None:
    tokenizer.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tokenizer service processes sharing --port (SO_REUSEPORT), each with its own "
        "engine connections (default: half the cores, at least 1)",
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


# What `pagedserve`'s usage line names; `build_parser(command)` names them all without
# importing clients/cli.py for the last six (clients.cli.CLIENT_COMMANDS; a test holds the two
# the same).
COMMANDS = ("serve", "engine", "tokenizer", "gateway")
COMMANDS += ("generate", "chat", "tokenize", "health", "lora", "bench")
ALONE_COMMANDS = ("engine", "tokenizer")  # the services `build_parser(command)` builds alone


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `pagedserve` parser; with `command` (one of ALONE_COMMANDS) only that command's
    subparser, which parses its flags and prints its help and errors as the whole parser does,
    without the client commands' and the gateway's imports (0.06 s of a service's start-up;
    docs/benchmarks.md, "The light tokenizer process and the Rust detokenizer")."""
    parser = argparse.ArgumentParser(prog="pagedserve", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    if command is not None:
        if command not in ALONE_COMMANDS:
            raise ValueError(f"build_parser({command!r}): one of {ALONE_COMMANDS} or None")
        commands.metavar = "{" + ",".join(COMMANDS) + "}"
        sub = commands.add_parser(command)
        _add_common_args(sub)
        if command == "engine":
            _add_engine_args(sub)
        else:
            _add_tokenizer_args(sub)
            _add_workers_arg(sub)
        add_security_args(sub, command)
        _add_observability_args(sub, command)
        _add_fleet_args(sub, command)
        return parser
    serve = commands.add_parser("serve", help="both services as child processes")
    engine = commands.add_parser("engine", help="the engine service")
    tokenizer = commands.add_parser("tokenizer", help="the tokenizer service (public API)")
    for sub in (serve, engine, tokenizer):
        _add_common_args(sub)
    for sub in (serve, engine):
        _add_engine_args(sub)
    for sub in (serve, tokenizer):
        _add_tokenizer_args(sub)
    _add_workers_arg(tokenizer)
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
    from clients.cli import add_client_commands
    from services.cli.openai_gateway import add_gateway_command, add_serve_openai_args

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
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv
