"""A rolling restart under load loses no stream (issue 34, "Drain"): three engine replicas
behind one tokenizer service are restarted one after the other — SIGTERM, drain, exit 0,
started again on the same port, routed to again — while clients keep streaming greedy and
seeded requests. No client sees an error, every stream completes with all its tokens and
equals the same request run without restarts, and afterwards every replica is idle with
every KV block free.

    clients ──▶ tokenizer service ──▶ A  B  C     restart A, then B, then C; at each SIGTERM
    (3 loops, and the test's                       a stream is mid-way there and is handed
     own streams)                                  back (counted); each restarted replica
                                                   serves a stream it owns again

The marathon is the stream a long generation is in a real rolling upgrade: it outlives
every restart. Its owner A is restarted first, which moves it to B; B is restarted next,
which moves it on — back to A, restarted meanwhile and the marathon's first choice again.
(The tokenizer service used to keep every replica a request had left out of its choices
for good, so a stream that had visited every replica ended UNAVAILABLE at the next
restart.) How many tokens a restart takes depends on the machine, so the marathon is held
still while its replica waits for the previous one to come back: that replica is
SIGSTOPped for the restart (stall detection is off here; the SIGSTOP tests are in
test_migration.py) and continued before its own SIGTERM.

Greedy streams are compared by DESIGN.md's top-5 rule, seeded ones exactly (they sample
among the top 5, as in test_migration.py).
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pagedserve.v1 import common_pb2
from tests.services.helpers import request, wait_for
from tests.services.processes import EngineProcess
from tests.services.tokenizer_service.replicas.fleet import (
    SHORT_GRACE,
    Fleet,
    Reader,
    assert_greedy_match,
    assert_text_is_the_tokens,
)

LONG = 200  # mid-way through one of these when its replica is restarted
SHORT = 24
MARATHON = "marathon"
# Long enough that the marathon cannot end in the moments between its replica being
# continued and that replica's drain handing it back (a fast engine made 300 tokens there).
MARATHON_TOKENS = 1500
NUM_CLIENTS = 3
GREEDY = {"temperature": 0.0, "logprobs": 5}  # the top-5 check needs the logprobs
SEEDED = {"temperature": 1.0, "seed": 7, "top_k": 5}
SEEDED_N2 = {"temperature": 0.8, "seed": 99, "n": 2, "top_k": 5}


@dataclass
class Spec:
    """One distinct request of the load: its prompt, sampling and length."""

    prompt: list[int]
    sampling: dict
    max_tokens: int

    def request(self, request_id: str):
        return request(
            token_ids=self.prompt,
            request_id=request_id,
            max_tokens=self.max_tokens,
            ignore_eos=True,
            **self.sampling,
        )

    @property
    def num_tokens(self) -> int:
        return self.max_tokens * self.sampling.get("n", 1)


@pytest.fixture(scope="module")
def fleet(tiny_model_dir) -> Iterator[Fleet]:
    # No stall detection, in either service: the SIGSTOP below holds the marathon still,
    # it is not a fault.
    fleet = Fleet(
        tiny_model_dir, engine_args=(*SHORT_GRACE, "--engine-stall-timeout", "0"), stall_timeout_s=0
    )
    yield fleet
    fleet.close()


def _specs(fleet: Fleet) -> list[Spec]:
    """For each replica, prompts it owns: a greedy and a seeded long stream and a short n=2
    one, interleaved so that every client soon sends to every replica."""
    per_engine = [fleet.prompts_owned_by(e, 3, seed=10 + i) for i, e in enumerate(fleet.engines)]
    kinds = ((GREEDY, LONG), (SEEDED, LONG), (SEEDED_N2, SHORT))
    return [
        Spec(per_engine[e][k], sampling, max_tokens)
        for k, (sampling, max_tokens) in enumerate(kinds)
        for e in range(len(fleet.engines))
    ]


class Client(threading.Thread):
    """Streams the specs one after another (from `offset` on) until told to stop."""

    def __init__(self, fleet: Fleet, specs: list[Spec], offset: int, stop: threading.Event):
        super().__init__(name=f"client{offset}", daemon=True)
        self.fleet, self.specs, self.offset, self.stop = fleet, specs, offset, stop
        self.current: tuple[Spec, str, Reader] | None = None
        self.done: list[tuple[Spec, str, object, dict]] = []

    def run(self) -> None:
        for k in itertools.count():
            if self.stop.is_set():
                return
            spec = self.specs[(self.offset + k) % len(self.specs)]
            request_id = f"{self.name}-{k}"
            reader = Reader(self.fleet.public.Generate(spec.request(request_id), timeout=300))
            self.current = (spec, request_id, reader)
            self.done.append((spec, request_id, *reader.result()))


class Restarts:
    """The rolling restart, one replica after the other, and the streams it starts itself:
    the marathon, a stream mid-way on each replica restarted while the marathon is not
    there, and a stream on each restarted replica to see it routed to again."""

    def __init__(self, fleet: Fleet, specs: list[Spec], marathon: Spec) -> None:
        self.fleet, self.specs = fleet, specs
        self.streams: list[tuple[Spec, str, Reader]] = []
        self.marathon = self.stream(marathon, MARATHON)
        self.moved: list[str] = []  # where each restart sent the marathon
        self.restarted: list[EngineProcess] = []
        self.held: EngineProcess | None = None  # SIGSTOPped, holding the marathon

    def stream(self, spec: Spec, request_id: str) -> Reader:
        reader = Reader(self.fleet.public.Generate(spec.request(request_id), timeout=600))
        self.streams.append((spec, request_id, reader))
        return reader

    def on(self, engine: EngineProcess, request_id: str, reader: Reader, num: int) -> None:
        """Until the stream has more than `num` tokens and runs on `engine`."""
        wait_for(lambda: self.fleet.holder(request_id) is engine, timeout=120, interval=0.001)
        wait_for(lambda: reader.num_tokens() > num, timeout=120)

    def next(self) -> EngineProcess:
        """The replica to restart, with a stream mid-way on it: the marathon's while that
        one has not been restarted, else the next one, with a long stream of its own."""
        on = self.fleet.holder(MARATHON)
        if on is not None and on not in self.restarted:
            if self.held is on:  # continued: the marathon runs there again
                num = self.marathon.num_tokens()
                os.kill(on.proc.pid, signal.SIGCONT)
                self.held = None
                self.on(on, MARATHON, self.marathon, num)
            return on
        engine = next(e for e in self.fleet.engines if e not in self.restarted)
        index = self.fleet.engines.index(engine)
        request_id = f"mid-way-{index}"
        spec = self.specs[len(self.fleet.engines) + index]  # its seeded long stream
        self.on(engine, request_id, self.stream(spec, request_id), 4)
        return engine

    def restart(self, engine: EngineProcess) -> None:
        """SIGTERM: exit status 0, a stream handed back and moved on (the marathon, when it
        was there, held still where it went); started again on the same port, and routed
        to again."""
        before = self.fleet.migrations("drained")
        had_marathon = self.fleet.holder(MARATHON) is engine
        engine.proc.terminate()
        assert engine.proc.wait(120) == 0, "a drain is a clean exit"
        wait_for(lambda: self.fleet.migrations("drained") > before, timeout=60)
        if had_marathon:
            # Moved (held by another replica) or ended; not the moment in between, when no
            # replica holds it yet (the new replica's call is still opening).
            wait_for(
                lambda: (
                    (holder := self.fleet.holder(MARATHON)) is not engine
                    and (holder is not None or not self.marathon.thread.is_alive())
                ),
                timeout=60,
            )
            to = self.fleet.holder(MARATHON)  # None: it ended (the comparison says how)
            if to is not None:
                self.moved.append(to.address)
            if to is not None and to not in self.restarted:
                os.kill(to.proc.pid, signal.SIGSTOP)  # the marathon waits there
                self.held = to
        engine.start()
        engine.wait_serving()
        wait_for(lambda: self.fleet.replica(engine).available, timeout=120)
        self.restarted.append(engine)
        index = self.fleet.engines.index(engine)
        request_id = f"back-{index}"
        spec = self.specs[index]  # its greedy long stream
        self.on(engine, request_id, self.stream(spec, request_id), 0)

    def close(self) -> None:
        if self.held is not None:
            os.kill(self.held.proc.pid, signal.SIGCONT)


def _assert_equal(fleet: Fleet, spec: Spec, request_id: str, error, got, want) -> None:
    assert error is None, f"{request_id}: {error}"
    assert sorted(got) == sorted(want), request_id
    for index, out in got.items():
        assert out.finish_reason == common_pb2.FINISH_REASON_LENGTH, request_id
        assert len(out.token_ids) == out.usage.completion_tokens == spec.max_tokens, request_id
        if "logprobs" in spec.sampling:
            assert_greedy_match(out, want[index])
        else:
            assert out.token_ids == want[index].token_ids, request_id  # seeded: exact
        if out.token_ids == want[index].token_ids:
            assert out.text == want[index].text, request_id  # nothing twice, nothing lost
        assert_text_is_the_tokens(fleet, out)


def test_a_rolling_restart_under_load_loses_no_stream(fleet):
    specs = _specs(fleet)
    a = fleet.engines[0]
    marathon = Spec(fleet.prompts_owned_by(a, 1, seed=99)[0], SEEDED, MARATHON_TOKENS)
    # Without restarts: every distinct request at once.
    all_specs = [*specs, marathon]
    readers = [
        Reader(fleet.public.Generate(s.request(f"ref-{i}"), timeout=300))
        for i, s in enumerate(all_specs)
    ]
    reference = {}
    for spec, reader in zip(all_specs, readers, strict=True):
        error, outputs = reader.result()
        assert error is None, error
        reference[id(spec)] = outputs

    stop = threading.Event()
    clients = [Client(fleet, specs, offset=2 * i, stop=stop) for i in range(NUM_CLIENTS)]
    for client in clients:
        client.start()
    restarts = Restarts(fleet, specs, marathon)
    try:
        wait_for(lambda: restarts.marathon.num_tokens() >= 8, timeout=120, interval=0.001)
        while len(restarts.restarted) < len(fleet.engines):
            restarts.restart(restarts.next())
    finally:
        restarts.close()
        stop.set()
    for client in clients:
        client.join(600)
        assert not client.is_alive(), "a client's stream hangs"

    # Every stream complete and unchanged, the marathon included.
    assert all(client.done for client in clients)
    finished = [entry for client in clients for entry in client.done]
    finished += [(spec, rid, *reader.result()) for spec, rid, reader in restarts.streams]
    for spec, request_id, error, outputs in finished:
        _assert_equal(fleet, spec, request_id, error, outputs, reference[id(spec)])
    # The marathon moved at A's and B's restarts, the second time back to A, restarted.
    assert len(restarts.moved) >= 2 and restarts.moved[1] == a.address, restarts.moved
    fleet.wait_all_up()
    for engine in fleet.engines:
        wait_for(lambda engine=engine: fleet.idle(engine), timeout=60)
