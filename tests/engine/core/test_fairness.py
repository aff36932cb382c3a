"""Fair sharing between fairness keys (engine.core.fairness), without torch or a model:
scripted arrivals into the real scheduler, a fake runner that samples a fixed token."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engine.api.sampling_params import SamplingParams
from engine.config.resolved import SchedulerConfig
from engine.core.fairness import FairQueue, VirtualTokenCounter
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from engine.core.scheduler import Scheduler

EOS = 2


def make_scheduler(
    fairness: str = "vtc",
    num_blocks: int = 512,
    block_size: int = 4,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 32,
    policy: str = "fcfs",
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=256,
        policy=policy,  # type: ignore[arg-type]
        fairness=fairness,  # type: ignore[arg-type]
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, True))


class Clients:
    """Makes requests with distinct prompts (no prefix-cache hits between them)."""

    def __init__(self) -> None:
        self.count = 0

    def request(
        self,
        key: str,
        num_prompt: int = 8,
        max_tokens: int = 8,
        weight: float = 1.0,
        priority: int = 0,
        name: str | None = None,
    ) -> Request:
        self.count += 1
        sampling = SamplingParams(max_tokens=max_tokens)
        sampling.update_from_generation_config({EOS})
        prompt = [1000 * self.count + i for i in range(num_prompt)]
        return Request(
            name or f"{key}-{self.count}",
            prompt,
            sampling,
            arrival_time=float(self.count),
            priority=priority,
            fairness_key=key,
            fairness_weight=weight,
        )


def fake_run(output: SchedulerOutput) -> ModelRunnerOutput:
    result = ModelRunnerOutput()
    for entry in output.scheduled:
        if entry.samples:
            result.sampled_token_ids[entry.request_id] = 7
    return result


def step(scheduler: Scheduler) -> tuple[SchedulerOutput, dict[str, float]]:
    """One step; returns its output and the weighted tokens it served per key
    (prompt tokens 1, output tokens 2, as VTC's defaults)."""
    output = scheduler.schedule()
    scheduler.update(output, fake_run(output))
    served = scheduler.fairness.drain_served()
    return output, {key: s.prompt + 2 * s.output for key, s in served.items()}


def keep_backlogged(
    scheduler: Scheduler,
    clients: Clients,
    key: str,
    weight: float,
    n: int,
    rng: random.Random | None = None,
) -> None:
    """Tops the key's waiting requests up to `n` (a tenant that floods the engine); with
    `rng`, prompts and outputs of 4 to 12 tokens, so the batch does not turn over in
    lockstep."""
    waiting = sum(1 for r in scheduler.waiting if r.fairness_key == key)
    for _ in range(n - waiting):
        num_prompt, max_tokens = (rng.randint(4, 12), rng.randint(4, 12)) if rng else (8, 8)
        scheduler.add_request(clients.request(key, num_prompt, max_tokens, weight=weight))


def test_weights_two_to_one_get_two_to_one_of_the_served_tokens() -> None:
    scheduler, clients, rng = make_scheduler(max_num_seqs=8), Clients(), random.Random(0)
    windows: list[Counter[str]] = []
    for number in range(400):
        # More waiting than the batch holds: neither key ever runs dry (a key that does is
        # lifted to the other's counter when its next request comes, by design).
        keep_backlogged(scheduler, clients, "heavy", 2.0, 16, rng)
        keep_backlogged(scheduler, clients, "light", 1.0, 16, rng)
        _, served = step(scheduler)
        if number % 50 == 0:  # about 1,200 weighted tokens, 70 requests, per window
            windows.append(Counter())
        windows[-1].update(served)
    for window in windows[1:]:  # the first window holds the start (both at zero)
        ratio = window["heavy"] / window["light"]
        assert 2 * 0.9 <= ratio <= 2 * 1.1, (ratio, windows)


def test_without_fairness_the_first_flood_takes_the_batch() -> None:
    """The contrast that makes the test above mean something: FCFS serves the key that
    queued first, and the other waits behind all of it."""
    scheduler, clients = make_scheduler(fairness="off"), Clients()
    for _ in range(40):
        scheduler.add_request(clients.request("heavy"))
    for _ in range(4):
        scheduler.add_request(clients.request("light"))
    served: Counter[str] = Counter()
    for _ in range(60):
        served.update(step(scheduler)[1])
    assert served["light"] == 0 and served["heavy"] > 0


def test_a_light_key_is_served_before_a_flood_that_queued_first() -> None:
    scheduler, clients = make_scheduler(), Clients()
    for _ in range(40):
        scheduler.add_request(clients.request("heavy"))
    step(scheduler)  # heavy fills the batch (4 running) and is ahead
    scheduler.add_request(clients.request("light", name="light-1"))
    admitted = []
    while "light-1" not in admitted:
        output, _ = step(scheduler)
        admitted += [e.request_id for e in output.scheduled if e.num_computed_tokens == 0]
    # The first free slot goes to the light key, not to the 36 heavy requests ahead of it.
    assert admitted[0] == "light-1", admitted


def test_an_idle_key_returns_without_a_burst_of_credit() -> None:
    scheduler, clients = make_scheduler(), Clients()
    for _ in range(200):  # a and b share the engine while c is idle
        keep_backlogged(scheduler, clients, "a", 1.0, 8)
        keep_backlogged(scheduler, clients, "b", 1.0, 8)
        step(scheduler)
    vtc = scheduler.fairness
    assert "c" not in vtc.keys
    level = min(vtc.counter("a"), vtc.counter("b"))
    served: Counter[str] = Counter()
    for _ in range(60):  # c floods too
        keep_backlogged(scheduler, clients, "a", 1.0, 8)
        keep_backlogged(scheduler, clients, "b", 1.0, 8)
        keep_backlogged(scheduler, clients, "c", 1.0, 8)
        if "c" in vtc.keys:
            assert vtc.counter("c") >= level  # lifted, not starting from zero
        served.update(step(scheduler)[1])
    share = served["c"] / sum(served.values())
    assert 0.25 <= share <= 0.42, (share, served)  # a third: neither a burst nor starved


def test_a_single_key_fills_the_batch_and_orders_as_without_fairness() -> None:
    """Work-conserving, and one key (here the default one) is scheduled exactly as the
    plain policy schedules."""
    runs = []
    for fairness in ("vtc", "off"):
        scheduler, clients = make_scheduler(fairness=fairness, policy="priority"), Clients()
        for i in range(20):
            scheduler.add_request(clients.request("", max_tokens=3 + i % 5, priority=i % 3))
        trace = []
        while scheduler.has_unfinished_requests():
            output = scheduler.schedule()
            if len(scheduler.waiting):
                assert len(scheduler.running) == 4  # the whole batch
            scheduler.update(output, fake_run(output))
            trace.append([(e.request_id, e.num_new_tokens) for e in output.scheduled])
        runs.append(trace)
    assert runs[0] == runs[1]


def test_one_backlogged_key_gets_the_whole_batch_beside_an_idle_one() -> None:
    scheduler, clients = make_scheduler(), Clients()
    scheduler.add_request(clients.request("idle", max_tokens=1))
    for _ in range(5):
        step(scheduler)
    for _ in range(12):
        scheduler.add_request(clients.request("busy"))
    step(scheduler)
    assert len(scheduler.running) == 4


def test_priority_still_orders_requests_within_a_key() -> None:
    scheduler, clients = make_scheduler(policy="priority", max_num_seqs=1), Clients()
    for name, priority in [("a-low", 0), ("a-urgent", 10), ("a-mid", 5)]:
        scheduler.add_request(clients.request("a", max_tokens=2, priority=priority, name=name))
    for name, priority in [("b-low", 0), ("b-urgent", 9)]:
        scheduler.add_request(clients.request("b", max_tokens=2, priority=priority, name=name))
    order = []
    while scheduler.has_unfinished_requests():
        output, _ = step(scheduler)
        order += [e.request_id for e in output.scheduled if e.num_computed_tokens == 0]
    assert [r for r in order if r.startswith("a")] == ["a-urgent", "a-mid", "a-low"]
    assert [r for r in order if r.startswith("b")] == ["b-urgent", "b-low"]
    # ... and the keys alternate, whatever the priorities across keys.
    assert order[:4] in (
        ["a-urgent", "b-urgent", "a-mid", "b-low"],
        ["b-urgent", "a-urgent", "b-low", "a-mid"],
    )


def preemption_victims(fairness: str) -> tuple[list[str], Scheduler]:
    """Two keys decode long outputs in a cache too small for all of them; "ahead" has
    weight 1 and "behind" weight 4, so "ahead" runs ahead of its share at once. "behind"
    queued last, so FCFS would preempt it first."""
    scheduler, clients = make_scheduler(fairness=fairness, num_blocks=24, max_num_seqs=4), Clients()
    for _ in range(2):
        scheduler.add_request(clients.request("ahead", max_tokens=30, weight=1.0))
    for _ in range(2):
        scheduler.add_request(clients.request("behind", max_tokens=30, weight=4.0))
    victims = []
    while scheduler.has_unfinished_requests():
        counters = {k: scheduler.fairness.counter(k) for k in ("ahead", "behind")}
        output, _ = step(scheduler)
        for request_id in sorted(output.preempted_request_ids):
            key = request_id.rpartition("-")[0]
            if fairness == "vtc":  # from the key most ahead at the step's start
                assert counters[key] == max(counters.values()), (request_id, counters)
            victims.append(key)
    return victims, scheduler


def test_preemption_takes_from_the_key_ahead_of_its_share() -> None:
    victims, scheduler = preemption_victims("vtc")
    assert victims and set(victims) == {"ahead"}, victims
    assert not scheduler.fairness.keys  # all finished: nothing left behind
    fcfs_victims, _ = preemption_victims("off")
    assert "behind" in fcfs_victims  # the rule above is not what FCFS would do anyway


def test_prompt_tokens_are_charged_once_and_cached_ones_not_at_all() -> None:
    scheduler, clients = make_scheduler(max_num_batched_tokens=64), Clients()
    first = clients.request("a", num_prompt=16, max_tokens=1, name="first")
    scheduler.add_request(first)
    _, served = step(scheduler)
    assert served == {"a": 16 + 2}  # 16 prompt tokens, one output token (x2)
    # The same prompt again: its first three blocks (12 tokens) come from the cache; the
    # last position is always computed.
    again = Request("again", list(first.prompt_token_ids), first.sampling_params, fairness_key="a")
    scheduler.add_request(again)
    _, served = step(scheduler)
    assert served == {"a": 4 + 2}


def test_idle_keys_are_forgotten_and_a_lone_newcomer_starts_level() -> None:
    scheduler, clients = make_scheduler(), Clients()
    for i in range(50):  # one-off keys, one after another
        scheduler.add_request(clients.request(f"once-{i}", max_tokens=2))
        while scheduler.has_unfinished_requests():
            step(scheduler)
    assert len(scheduler.fairness.keys) == 0
    scheduler.add_request(clients.request("x"))
    scheduler.add_request(clients.request("y"))
    vtc = scheduler.fairness
    assert vtc.counter("x") == vtc.counter("y") > 0  # both at the last key's level


def test_counter_divides_by_the_weight() -> None:
    vtc = VirtualTokenCounter(prompt_weight=1.0, output_weight=2.0)
    request = Clients().request("k", num_prompt=10, weight=2.5)
    vtc.on_added(request)
    vtc.on_scheduled(request, 10)
    vtc.on_output(request, 3)
    assert vtc.counter("k") == pytest.approx((10 + 2 * 3) / 2.5)


def test_bad_fairness_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="fairness must be"):
        SchedulerConfig(fairness="wfq")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fairness_output_token_weight"):
        SchedulerConfig(fairness_output_token_weight=-1.0)


def test_on_a_tie_the_key_with_fewer_waiting_requests_goes_first() -> None:
    """An interactive user with one request waiting goes before a batch job level with it
    (a returning key is lifted to exactly the backlogged key's counter: a tie)."""
    vtc, clients = VirtualTokenCounter(), Clients()
    queue = FairQueue("fcfs", vtc)
    for _ in range(5):
        queue.add(clients.request("batch"))
    queue.add(clients.request("user", name="user-1"))
    assert vtc.counter("user") == vtc.counter("batch")
    assert queue.pop().request_id == "user-1"
    assert queue.pop().fairness_key == "batch" and len(queue) == 4


def test_a_small_batch_is_shared_two_to_one_request_by_request() -> None:
    """Batch of 4, two keys of weights 2 and 1 with alike requests all queued at once (the
    batch turns over in lockstep). Admission must share the slots 3+1, 3+1, 2+2 (8:4), so
    every window of three requests' length serves 2:1 of the output tokens: with a counter
    that moved only as tokens came, a batch that freed went to one key whole (4+0, then
    0+4) and the first window served 1:1."""
    scheduler, clients = make_scheduler(max_num_batched_tokens=256), Clients()
    for _ in range(32):
        for key, weight in (("gold", 2.0), ("gold", 2.0), ("bronze", 1.0)):
            scheduler.add_request(clients.request(key, num_prompt=16, max_tokens=32, weight=weight))
    windows: list[Counter[str]] = []
    for number in range(96 * 5):  # 5 windows of 3 requests' length, both keys backlogged
        if number % 96 == 0:
            windows.append(Counter())
        output = scheduler.schedule()
        scheduler.update(output, fake_run(output))
        served = scheduler.fairness.drain_served()
        windows[-1].update({key: tokens.output for key, tokens in served.items()})
    ratios = [window["gold"] / max(1, window["bronze"]) for window in windows]
    assert all(2 * 0.8 <= ratio <= 2 * 1.2 for ratio in ratios), ratios


def test_a_client_that_sends_a_request_as_one_ends_keeps_its_share() -> None:
    """Closed-loop clients: each key keeps 3 requests in the engine and sends the next the
    moment one ends, so at weights 2:1 (2.67 of 4 slots for gold) gold's queue is often
    empty for an instant. Lifted to bronze's counter on each return, as an idle key is, it
    lost its lag every time: 1.61:1 (1.71:1 with admission reserving). Keeping up to one
    request's cost of lag per request it has in the engine: 1.96:1."""
    scheduler, clients, rng = (
        make_scheduler(max_num_batched_tokens=256),
        Clients(),
        random.Random(0),
    )
    weights = {"gold": 2.0, "bronze": 1.0}
    for key, weight in weights.items():
        for _ in range(3):
            scheduler.add_request(clients.request(key, num_prompt=30, max_tokens=64, weight=weight))
    served: Counter[str] = Counter()
    for number in range(3000):
        output = scheduler.schedule()
        for request in scheduler.update(output, fake_run(output)):
            if request.is_finished():
                key = request.fairness_key
                max_tokens = rng.randint(32, 96)  # not in lockstep
                scheduler.add_request(clients.request(key, 30, max_tokens, weight=weights[key]))
        tokens = scheduler.fairness.drain_served()
        if number >= 300:  # past the start
            served.update({key: t.output for key, t in tokens.items()})
    ratio = served["gold"] / served["bronze"]
    assert 2 * 0.9 <= ratio <= 2 * 1.1, (ratio, served)
