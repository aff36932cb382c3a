"""A rolling restart under load loses no stream (issue 34, "Drain"): three engine replicas
behind one tokenizer service are restarted one after the other — SIGTERM, drain, exit 0,
started again on the same port, routed to again — while clients keep streaming greedy and
seeded requests. No client sees an error, every stream completes with all its tokens and
equals the same request run without restarts, and afterwards every replica is idle with
every KV block free.

    clients ──▶ tokenizer service ──▶ A  B  C       restart A, then B, then C:
    (4 loops + the marathon)                          each SIGTERM hands back ≥ 1 stream
                                                      mid-way (counted), each restarted
                                                      replica serves a stream again

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
)

LONG = 240  # mid-way through one of these when its replica is restarted
SHORT = 24
MARATHON = "marathon"
MARATHON_TOKENS = 400
NUM_CLIENTS = 4
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


def _mid_way_on(fleet: Fleet, clients: list[Client], engine: EngineProcess) -> bool:
    """A long stream has started on `engine` and has at least two thirds of its tokens to
    go: far more than the short drain lets it make."""
    for client in clients:
        if client.current is None:
            continue
        spec, request_id, reader = client.current
        num = reader.num_tokens()
        long_way_to_go = spec.max_tokens == LONG and 4 <= num <= spec.num_tokens // 3
        if long_way_to_go and fleet.holder(request_id) is engine:
            return True
    return False


def _restart(fleet: Fleet, engine: EngineProcess, moved: list[str]) -> EngineProcess | None:
    """SIGTERM `engine` and check that it drains: exit status 0, and at least one stream
    handed back and moved on. Returns where the marathon went, when it was on `engine`."""
    before = fleet.migrations("drained")
    had_marathon = fleet.holder(MARATHON) is engine
    engine.proc.terminate()
    assert engine.proc.wait(120) == 0, "a drain is a clean exit"
    wait_for(lambda: fleet.migrations("drained") > before, timeout=60)
    if not had_marathon:
        return None
    wait_for(lambda: fleet.holder(MARATHON) is not engine, timeout=60)
    to = fleet.holder(MARATHON)  # None: it ended (an error, which the comparison shows)
    if to is not None:
        moved.append(to.address)
    return to


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
        assert out.text == fleet.files.tokenizer.decode(out.token_ids, skip_special_tokens=True)


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
    marathon_reader = Reader(fleet.public.Generate(marathon.request(MARATHON), timeout=600))
    probes: list[tuple[Spec, str, Reader]] = []
    moved: list[str] = []  # where each restart sent the marathon
    restarted: list[EngineProcess] = []
    held: EngineProcess | None = None  # the SIGSTOPped replica holding the marathon
    try:
        wait_for(lambda: marathon_reader.num_tokens() >= 8, timeout=120, interval=0.001)
        while len(restarted) < len(fleet.engines):
            on = fleet.holder(MARATHON)
            if on is not None and on not in restarted:
                engine = on
                if held is engine:  # continued: the marathon runs there again
                    num = marathon_reader.num_tokens()
                    os.kill(engine.proc.pid, signal.SIGCONT)
                    held = None
                    wait_for(lambda n=num: marathon_reader.num_tokens() > n, timeout=120)
            else:
                engine = next(e for e in fleet.engines if e not in restarted)
                wait_for(lambda e=engine: _mid_way_on(fleet, clients, e), timeout=300)
            to = _restart(fleet, engine, moved)
            if to is not None and to not in restarted:
                os.kill(to.proc.pid, signal.SIGSTOP)  # the marathon waits there
                held = to
            engine.start()
            engine.wait_serving()
            wait_for(lambda e=engine: fleet.replica(e).available, timeout=120)
            restarted.append(engine)
            # Routed to again: a stream it owns starts there and makes tokens.
            index = fleet.engines.index(engine)
            spec = specs[index]  # its greedy long stream
            probe_id = f"probe-{index}"
            probe = Reader(fleet.public.Generate(spec.request(probe_id), timeout=300))
            probes.append((spec, probe_id, probe))
            wait_for(lambda p=probe_id, e=engine: fleet.holder(p) is e, timeout=120, interval=0.001)
            wait_for(lambda p=probe: p.num_tokens() > 0, timeout=120)
    finally:
        if held is not None:
            os.kill(held.proc.pid, signal.SIGCONT)
        stop.set()
    for client in clients:
        client.join(600)
        assert not client.is_alive(), "a client's stream hangs"

    # Every stream complete and unchanged, the marathon included.
    finished = [entry for client in clients for entry in client.done]
    finished += [(spec, rid, *reader.result()) for spec, rid, reader in probes]
    finished.append((marathon, MARATHON, *marathon_reader.result()))
    assert all(client.done for client in clients)
    for spec, request_id, error, outputs in finished:
        _assert_equal(fleet, spec, request_id, error, outputs, reference[id(spec)])
    # The marathon moved at A's and B's restarts, the second time back to A, restarted.
    assert len(moved) >= 2 and moved[1] == a.address, moved
    fleet.wait_all_up()
    for engine in fleet.engines:
        wait_for(lambda engine=engine: fleet.idle(engine), timeout=60)
