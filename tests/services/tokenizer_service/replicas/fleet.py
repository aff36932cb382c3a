"""Engine replicas as real processes behind one in-process tokenizer service, and the client
side of their streams: what the fleet tests (test_migration.py, test_rolling_restart.py)
share.

    Fleet ── engines: [EngineProcess] (loopback ports; `--shutdown-grace` short; forked
      │               from the engine zygote, tests/services/engine_zygote.py, so a
      │               restart costs seconds, not an interpreter's imports)
      │      server:  TokenizerServer on a LoopThread, routing by prefix affinity
      └───── public:  a TextGenerationService stub, the client's view

The tests read the tokenizer service's own state (which replica holds a request, its
migration counter) because that is the only place it exists; the engines' state comes from
their Health details, as an operator would read it.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from pathlib import Path
from types import SimpleNamespace

import grpc

from pagedserve.v1 import common_pb2, engine_pb2_grpc, generation_pb2_grpc
from services.tokenizer_service.model_files import load_text_model_files
from services.tokenizer_service.replicas import routing
from services.tokenizer_service.server import TokenizerServer, TokenizerServerConfig
from tests.services.conftest import LoopThread
from tests.services.helpers import gather, wait_for
from tests.services.processes import EngineProcess

BLOCK = 16
PREFIX_BLOCKS = 4
SHORT_GRACE = ("--shutdown-grace", "0.2")  # SIGTERM hands the streams back after 0.2 s


class Fleet:
    def __init__(
        self,
        model_dir: Path,
        *,
        num_engines: int = 3,
        engine_args: tuple[str, ...] = SHORT_GRACE,
        stall_timeout_s: float = 2.0,
        engine_envs: list[dict[str, str]] | None = None,
        forked: bool = True,
    ) -> None:
        envs = engine_envs or [{}] * num_engines
        self.engines = [
            EngineProcess(model_dir, None, *engine_args, env=env, forked=forked) for env in envs
        ]
        for engine in self.engines:
            engine.start()
        for engine in self.engines:
            engine.wait_serving()
        self.files = load_text_model_files(str(model_dir))
        self.loop = LoopThread()

        async def start() -> TokenizerServer:
            config = TokenizerServerConfig(
                address="127.0.0.1:0",
                engine_address=",".join(e.address for e in self.engines),
                engine_poll_interval_s=0.2,
                route_prefix_blocks=PREFIX_BLOCKS,
                engine_stall_timeout_s=stall_timeout_s,
            )
            server = TokenizerServer(config, self.files)
            await server.start()
            assert await server.backend.wait_until_available(60.0)
            return server

        self.server = self.loop.run(start())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.public = generation_pb2_grpc.TextGenerationServiceStub(self.channel)

    def replica(self, engine: EngineProcess):
        return self.server.backend.replicas[engine.address]

    def wait_all_up(self) -> None:
        wait_for(lambda: all(self.replica(e).available for e in self.engines), timeout=120)

    def revive(self) -> None:
        """Starts again, side by side, every engine that is not running (killed, or exited
        after a drain) and waits until all are routed to. A test that needs the whole fleet
        calls it first, rather than each test restarting its victim last: the last victim of
        a module is not restarted for nothing, and two victims start together."""
        down = [e for e in self.engines if e.proc is None or e.proc.poll() is not None]
        for engine in down:
            engine.start()
        for engine in down:
            engine.wait_serving()
        self.wait_all_up()

    def holder(self, request_id: str) -> EngineProcess | None:
        """The engine holding request `request_id` now (None: not in flight)."""
        live = self.server.servicer.requests.get(request_id)
        if live is None or live.replica is None:
            return None
        return next(e for e in self.engines if e.address == live.replica.address)

    def owner(self, prompt: list[int]) -> EngineProcess:
        key = routing.affinity_key(prompt, BLOCK, PREFIX_BLOCKS)
        first = routing.rank(key, [SimpleNamespace(address=e.address) for e in self.engines])[0]
        return next(e for e in self.engines if e.address == first.address)

    def prompts_owned_by(self, engine: EngineProcess, num: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        found: list[list[int]] = []
        while len(found) < num:
            prompt = [rng.randrange(3, 49152) for _ in range(PREFIX_BLOCKS * BLOCK + 4)]
            if self.owner(prompt) is engine:
                found.append(prompt)
        return found

    def engine_details(self, engine: EngineProcess) -> dict[str, str]:
        with grpc.insecure_channel(engine.address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            return dict(stub.Health(common_pb2.HealthRequest(), timeout=10).details)

    def idle(self, engine: EngineProcess) -> bool:
        """No request left and every KV block free."""
        d = self.engine_details(engine)
        return d["num_engine_requests"] == "0" and d["num_free_kv_blocks"] == d["num_kv_blocks"]

    def migrations(self, reason: str) -> float:
        registry = self.server.servicer.rpc_metrics.registry
        value = registry.get_sample_value("pagedserve:request_migrations_total", {"reason": reason})
        return value or 0.0

    def close(self) -> None:
        self.channel.close()
        self.loop.run(self.server.stop(0))
        self.loop.close()
        for engine in self.engines:
            if engine.proc is not None and engine.proc.poll() is None:
                os.kill(engine.proc.pid, signal.SIGCONT)  # a stopped one cannot terminate
            engine.stop()


class Reader:
    """Reads one stream in a thread; `num_tokens()` so far, `result()` at the end."""

    def __init__(self, call) -> None:
        self.call = call
        self.responses: list = []
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self.responses.append(response)
        except grpc.RpcError as exc:
            self.error = exc

    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in list(self.responses))

    def result(self):
        self.thread.join(300)
        assert not self.thread.is_alive(), "the stream hangs"
        return self.error, gather(self.responses)


def run_undisturbed(fleet: Fleet, requests: list) -> list[dict]:
    """Each request's outputs run without a fault, all streamed at once (as the faulted
    run streams them, and in one stream's time rather than one after the other)."""
    readers = [Reader(fleet.public.Generate(r, timeout=300)) for r in requests]
    outputs = []
    for reader in readers:
        error, out = reader.result()
        assert error is None, error
        outputs.append(out)
    return outputs


def assert_greedy_match(got, want) -> None:
    """Equal tokens, or at the first divergence each side's token within the other's top-5
    (DESIGN.md "Correctness reference")."""
    assert len(got.logprobs) == len(got.token_ids)  # logprobs for every token, moved or not
    for pos, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=True)):
        if a != b:
            assert a in {e.token_id for e in want.logprobs[pos].top}, pos
            assert b in {e.token_id for e in got.logprobs[pos].top}, pos
            return


def assert_text_is_the_tokens(fleet: Fleet, out) -> None:
    """A stream's text is its tokens decoded: nothing sent twice, nothing lost across a move.
    One allowance, as vLLM's incremental detokenizer makes it: half of a UTF-8 character at
    the very end (the last token's bytes end mid-character) is never sent, so the stream's
    text lacks the U+FFFD the whole decode ends with."""
    decoded = fleet.files.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    if out.text != decoded:
        assert decoded.endswith("\ufffd"), (out.text[-20:], decoded[-20:])
        assert out.text == decoded.rstrip("\ufffd")
