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
Tracing follows the standard OTEL_* variables (docs/observability.md). The flags and their
parser: services/cli/flags.py; this module runs the command.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import gc
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from services.cli.flags import ALONE_COMMANDS, build_parser, engine_args_from
from services.cli.secure_flags import engine_link_tls_from, request_limits_from, server_tls_from

logger = logging.getLogger("services.cli.main")

# ---- the services -------------------------------------------------------------------------


def _metrics_address(host: str, port: int) -> str | None:
    return f"{host}:{port}" if port else None


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
    """The engine service until a signal or the engine's death. The collector stays off
    while the service starts: torch's and the engine's imports and the model's load make
    ~190,000 long-lived objects, and the collections they set off (3-5 full ones among
    400-800) took 0.4-1.3 s of a start on a loaded 2-core machine while freeing next to
    nothing (docs/benchmarks.md, "Engine start-up"). Once the engine serves, what start-up
    made is frozen out of the collector's reach (a full collection over it paused the event
    loop and the engine's steps for 0.2 s; 0.0 ms frozen), and the collector runs again."""
    gc.disable()
    try:
        return await _serve_engine(ns)
    finally:
        gc.enable()


async def _serve_engine(ns: argparse.Namespace) -> int:
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
        gc.freeze()
        gc.enable()
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
    from services.cli.tokenizer_workers import worker_identity
    from services.common.grpc_server import on_sighup, wait_for_signal
    from services.common.tracing import TOKENIZER_SERVICE_NAME, setup_tracing
    from services.tokenizer_service.model_files import load_text_model_files
    from services.tokenizer_service.server import TokenizerServer, TokenizerServerConfig

    setup_tracing(TOKENIZER_SERVICE_NAME)  # flushed at exit by the provider itself
    files = await asyncio.to_thread(load_text_model_files, ns.model)
    worker = worker_identity()  # one of `--workers N` (services/cli/tokenizer_workers.py)
    metrics_address = _metrics_address(ns.host, ns.metrics_port)
    metrics_name_prefix = ns.metrics_name_prefix
    if worker is not None:  # its metrics go out through the first process, renamed there
        metrics_address = _metrics_address("127.0.0.1", worker[1])
        metrics_name_prefix = "pagedserve"
    server = TokenizerServer(
        TokenizerServerConfig(
            address=f"{ns.host}:{ns.port}",
            engine_address=ns.engine_addr,
            max_inflight_requests=ns.max_inflight_requests,
            max_prompt_tokens=ns.max_prompt_tokens,
            max_message_bytes=ns.max_message_bytes,
            shutdown_grace_s=ns.shutdown_grace,
            metrics_address=metrics_address,
            metrics_name_prefix=metrics_name_prefix,
            route_policy=ns.route_policy,
            migration_limit=ns.migration_limit,
            engine_stall_timeout_s=ns.engine_stall_timeout,
            engine_multiplex=not ns.engine_per_request_calls,
            stream_interval=ns.stream_interval,
            tls=server_tls_from(ns),
            engine_tls=engine_link_tls_from(ns),
            api_key_file=ns.api_key_file,
            limits=request_limits_from(ns),
            reuse_port=worker is not None,
        ),
        files,
    )
    await server.start()
    # What start-up made (modules, the tokenizer, the server) lives as long as the process;
    # frozen, the collector no longer walks it: a full collection (a pause of the event loop)
    # took 9-19 ms over those ~38,000 objects, 0.0 ms once frozen (docs/benchmarks.md, "The
    # light tokenizer process and the Rust detokenizer").
    gc.freeze()
    on_sighup(server.reload)
    await wait_for_signal()
    await server.stop()
    return 0


def _exit_without_teardown(code: int) -> NoReturn:
    """Ends a service process as the interpreter's own exit would, less the teardown of its
    modules: the other non-daemon threads are joined, the atexit handlers run (the log
    handlers, the tracing provider's flush, multiprocessing's children), stdout and stderr
    are flushed, and the exit status is `code`. Tearing down torch's and transformers'
    thousands of modules and objects took an idle engine service 2-3 s of CPU after it had
    stopped serving (docs/benchmarks.md, "Service start-up"): time every restart, rolling
    upgrade and test waited for, with nothing left to do."""
    # What the interpreter's exit does first (and multiprocessing's process exit): tells the
    # idle workers of thread pools to end, then joins every non-daemon thread.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    from services.common.log import setup_logging

    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in ALONE_COMMANDS:  # a service alone: no client or gateway imports
        parser = build_parser(args[0])
    else:
        from clients.cli import CLIENT_COMMANDS
        from clients.cli import main as client_main

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

    if ns.command == "tokenizer":
        from services.cli.tokenizer_workers import default_workers, run_workers, worker_identity

        if worker_identity() is None and (ns.workers or default_workers()) > 1:
            ns.workers = ns.workers or default_workers()
            return run_workers(ns, args)
    runner = run_engine if ns.command == "engine" else run_tokenizer
    try:
        code = asyncio.run(runner(ns))
    except ConfigError as exc:  # a bad TLS / key file or an insecure bind: one line, no trace
        logger.error("cannot start: %s", exc)
        return 2
    if argv is None:  # the process's own command line: the service has stopped, exit now
        _exit_without_teardown(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
