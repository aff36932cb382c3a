"""The client subcommands of `pagedserve` (also `python -m clients`); none imports torch.

    pagedserve generate "prompt"   stream one answer to the terminal (--chat: as a user message)
    pagedserve chat                an interactive chat: one stdin line per turn, history kept;
                                   /reset clears it, /exit or EOF quits
    pagedserve tokenize "text"     token ids and token strings
    pagedserve health              the server's health; exit status 0 when SERVING (--wait S:
                                   until it is, at most S seconds)
    pagedserve lora load|unload|list   LoRA adapters on every engine replica (admin key)
    pagedserve bench serve         the serving benchmark (clients/bench.py)
    pagedserve bench plot          latency against request rate from saved results

Every command takes --address (default $PAGEDSERVE_ADDRESS, else localhost:50051) and the TLS
flags; generate and chat take the sampling flags (vLLM's names) and --lora-name (an adapter
loaded with `pagedserve lora load`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from clients.bench import add_serve_args, main_serve
from clients.bench_plot import add_plot_args, main_plot
from clients.cli_common import add_connection_args, connection_kwargs, print_error
from clients.client import Client
from clients.errors import PagedServeError
from clients.outputs import ResultBuilder

CLIENT_COMMANDS = ("generate", "chat", "tokenize", "health", "lora", "bench")

# Sampling flags: SamplingParams fields; logprobs have no place on a terminal.
_SAMPLING_FLAGS: dict[str, type] = {
    "n": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "seed": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
    "max_tokens": int,
    "min_tokens": int,
}
_SAMPLING_SWITCHES = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (SamplingParams; unset: the model's defaults)")
    for name, kind in _SAMPLING_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    for name in _SAMPLING_SWITCHES:
        flag = "--" + name.replace("_", "-")
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
    group.add_argument("--stop", action="append", default=None, help="a stop string (repeat)")
    group.add_argument("--stop-token-ids", type=int, nargs="+", default=None, help="stop token ids")


def _sampling(ns: argparse.Namespace) -> dict[str, Any]:
    """The generate() keyword arguments: the sampling flags that were given, and the adapter."""
    names = [*_SAMPLING_FLAGS, *_SAMPLING_SWITCHES, "stop", "stop_token_ids"]
    kwargs = {name: getattr(ns, name) for name in names if getattr(ns, name) is not None}
    if ns.lora_name:
        kwargs["lora_name"] = ns.lora_name
    return kwargs


def _client(ns: argparse.Namespace) -> Client:
    return Client(**connection_kwargs(ns), timeout=ns.timeout)


# ---- generate -----------------------------------------------------------------------------


def _stream_to(out: TextIO, stream: Any, echo: bool) -> ResultBuilder:
    """Gathers `stream`; writes output 0's text to `out` as it arrives when `echo`."""
    builder = ResultBuilder()
    for delta in stream:
        builder.add(delta)
        if echo and delta.index == 0 and delta.text:
            out.write(delta.text)
            out.flush()
    return builder


def run_generate(ns: argparse.Namespace) -> int:
    sampling = _sampling(ns)
    messages = None
    if ns.chat:
        messages = [{"role": "system", "content": ns.system}] if ns.system else []
        messages.append({"role": "user", "content": ns.prompt})
    start = time.perf_counter()
    with _client(ns) as client:
        prompt = None if ns.chat else ns.prompt
        with client.generate(prompt, messages=messages, **sampling) as stream:
            result = _stream_to(sys.stdout, stream, echo=(ns.n or 1) == 1).result()
    elapsed = time.perf_counter() - start
    if len(result.outputs) > 1:
        for out in result.outputs:
            print(f"--- output {out.index} (finish_reason={out.finish_reason}) ---\n{out.text}")
    else:
        print()
    tokens = result.usage.completion_tokens
    print(
        f"[{tokens} tokens in {elapsed:.2f} s ({tokens / max(elapsed, 1e-9):.1f} tok/s), "
        f"finish_reason={','.join(str(r) for r in result.finish_reasons)}]",
        file=sys.stderr,
    )
    return 0


# ---- chat ---------------------------------------------------------------------------------


def run_chat(ns: argparse.Namespace, stdin: TextIO = sys.stdin) -> int:
    """One stdin line per user turn; the answer streams to stdout."""
    base = [{"role": "system", "content": ns.system}] if ns.system else []
    history = list(base)
    interactive = stdin.isatty()
    if interactive:
        print("Chat with the model; /reset clears the history, /exit or Ctrl-D quits.")
    with _client(ns) as client:
        while True:
            if interactive:
                print(">>> ", end="", flush=True)
            line = stdin.readline()
            if not line or line.strip() == "/exit":
                return 0
            text = line.strip()
            if text == "/reset":
                history = list(base)
                continue
            if not text:
                continue
            history.append({"role": "user", "content": text})
            try:
                with client.generate(messages=history, **_sampling(ns)) as stream:
                    answer = _stream_to(sys.stdout, stream, echo=True).result().text
            except PagedServeError as exc:
                history.pop()
                print_error(exc)
                continue
            except KeyboardInterrupt:  # stops this answer (the server aborts it), not the chat
                history.pop()
                print("\n[interrupted]", file=sys.stderr)
                continue
            print(flush=True)
            history.append({"role": "assistant", "content": answer})


# ---- tokenize, health ---------------------------------------------------------------------


def run_tokenize(ns: argparse.Namespace) -> int:
    messages = [{"role": "user", "content": ns.text}] if ns.chat else None
    with _client(ns) as client:
        result = client.tokenize(
            None if ns.chat else ns.text,
            messages=messages,
            add_special_tokens=ns.add_special_tokens,
        )
    print(f"count: {result.count} (max_model_len {result.max_model_len})")
    print(f"token_ids: {result.token_ids}")
    print(f"tokens: {result.tokens}")
    return 0


_HEALTH_POLL_S = 0.5


def run_health(ns: argparse.Namespace) -> int:
    """One health call; with `--wait S`, asks again (a server still starting is unreachable
    or NOT_SERVING) until it is SERVING or S seconds have passed, so a script can start a
    server in the background and go on once it answers."""
    deadline = time.monotonic() + max(ns.wait, 0.0)
    with _client(ns) as client:
        while True:
            try:
                status = client.health()
                if status.healthy and status.status == "SERVING":
                    break
            except PagedServeError:
                if time.monotonic() >= deadline:
                    raise
            if time.monotonic() >= deadline:
                break
            time.sleep(_HEALTH_POLL_S)
    print(status.status)
    for key, value in sorted(status.details.items()):
        print(f"  {key}: {value}")
    return 0 if status.healthy and status.status == "SERVING" else 1


def run_lora(ns: argparse.Namespace) -> int:
    """`lora load NAME PATH`, `lora unload NAME`, `lora list` (admin RPCs)."""
    with _client(ns) as client:
        if ns.lora_command == "load":
            lora_int_id = client.load_lora_adapter(ns.name, ns.path)
            print(f"loaded {ns.name} (lora_int_id {lora_int_id})")
        elif ns.lora_command == "unload":
            client.unload_lora_adapter(ns.name)
            print(f"unloaded {ns.name}")
        else:
            for adapter in client.list_lora_adapters():
                print(f"{adapter.lora_name}\t{adapter.lora_int_id}\t{adapter.lora_path}")
    return 0


# ---- the parser ---------------------------------------------------------------------------


def _connection(parser: argparse.ArgumentParser, timeout: float | None) -> None:
    add_connection_args(parser)
    parser.add_argument(
        "--timeout", type=float, default=timeout, help=f"seconds for the call ({timeout})"
    )


def add_client_commands(commands: Any) -> None:
    """Adds the client subcommands to `commands` (an argparse subparsers action); each sets
    `client_main`, the function that runs it."""
    generate = commands.add_parser("generate", help="stream an answer from a server")
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="send as a user chat message")
    generate.add_argument("--system", default=None, help="a system message (with --chat)")
    chat = commands.add_parser("chat", help="chat interactively with a server")
    chat.add_argument("--system", default=None, help="a system message")
    for sub in (generate, chat):
        _connection(sub, None)
        _add_sampling_args(sub)
        sub.add_argument(
            "--lora-name", default="", help="a loaded LoRA adapter (default: the base model)"
        )
    generate.set_defaults(client_main=run_generate)
    chat.set_defaults(client_main=run_chat)

    tokenize = commands.add_parser("tokenize", help="tokenize text with the server's tokenizer")
    tokenize.add_argument("text")
    tokenize.add_argument("--chat", action="store_true", help="render as a user chat message")
    tokenize.add_argument(
        "--add-special-tokens", action=argparse.BooleanOptionalAction, default=None
    )
    _connection(tokenize, 30.0)
    tokenize.set_defaults(client_main=run_tokenize)

    health = commands.add_parser("health", help="exit status 0 when the server is SERVING")
    _connection(health, 5.0)
    health.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="ask again until SERVING or this many seconds have passed (0: ask once)",
    )
    health.set_defaults(client_main=run_health)

    lora = commands.add_parser("lora", help="LoRA adapters on the engines (admin API key)")
    lora_commands = lora.add_subparsers(dest="lora_command", required=True)
    load = lora_commands.add_parser("load", help="load a PEFT adapter directory under a name")
    load.add_argument("name", help="the name requests give in --lora-name / lora_name")
    load.add_argument("path", help="the adapter directory on the engines' hosts")
    unload = lora_commands.add_parser("unload", help="unload an adapter by name")
    unload.add_argument("name")
    listing = lora_commands.add_parser("list", help="the loaded adapters: name, id, path")
    for sub in (load, unload, listing):
        _connection(sub, 60.0)
        sub.set_defaults(client_main=run_lora)

    bench = commands.add_parser("bench", help="serving benchmark").add_subparsers(
        dest="bench_command", required=True
    )
    serve = bench.add_parser("serve", help="benchmark a running server (vllm bench serve)")
    add_serve_args(serve)
    serve.set_defaults(client_main=main_serve)
    plot = bench.add_parser("plot", help="plot latency against request rate from results")
    add_plot_args(plot)
    plot.set_defaults(client_main=main_plot)


def run(ns: argparse.Namespace) -> int:
    """Runs a parsed client command; a failed call prints its status and returns 1."""
    try:
        return ns.client_main(ns)
    except PagedServeError as exc:
        print_error(exc)
        return 1
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__.splitlines()[0])
    add_client_commands(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))
