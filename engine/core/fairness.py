"""Fair sharing between fairness keys (tenants): the Virtual Token Counter.

Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024). Each key has a
counter that grows by the tokens it is served, divided by its weight:

    counter[key] += (prompt_weight * new prompt tokens + output_weight * output tokens) / weight

Prompt tokens are charged when a step computes them (prefix-cache hits cost nothing, a
prompt recomputed after a preemption is not charged twice); output tokens when they are
appended.

Admission reserves. The scheduler admits whole requests, and a request keeps its slot
until it ends, so a counter that only moved as tokens arrive would let one key take every
slot that frees in a step (its counter does not move until the tokens come), and the batch
would swing between keys in waves of whole requests: with a batch of 4, two keys at 2:1
ran 4+0, then 0+4, a request's length each, instead of 3+1, 3+1, 2+2. So an admitted request
reserves the output it is expected to make (its remaining `max_tokens`, at most the mean
output of its key's finished requests), and the order reads each key's `virtual` counter:
charged + reserved, over the weight. A delivered token moves cost from reserved to charged;
what is left is released when the request ends or is preempted. The charge itself is
unchanged: the shares are decided by what was delivered.

The scheduler asks three things of it:

    waiting order    `FairQueue.peek`: the head (by the fcfs/priority policy) of the
                     backlogged key with the smallest virtual counter; ties go to the key with
                     fewer waiting requests (an interactive user with one request goes
                     before a batch job level with it), then to the earlier head
    running order    `order_running`: by counter, stable, so a preemption (which takes the
                     last running request) takes from the key most ahead of its share
    no hoarding      a key that had no waiting request is lifted to the smallest counter
                     of the backlogged keys when a request arrives (else of the keys with
                     running requests, else of the level the last active key left at), so
                     credit saved while idle cannot buy a burst, and the newcomer is not
                     starved either; a key that still had requests running keeps up to one
                     request's cost of lag per request it has in the engine (a client that
                     sends the next request when one ends is backlogged, though its queue
                     was empty for a moment: lifted all the way, it lost its share)

Work-conserving by construction: the order only decides who goes first; a single
backlogged key gets the whole batch. Requests without a key share `DEFAULT_KEY` (""), so an
engine without tenants orders exactly as the plain policy does.

Keys that go idle level with or behind the others are forgotten (they would be lifted on
return anyway), so a stream of one-off keys does not grow the state without bound.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from engine.core.request import Request
from engine.core.request_queue import RequestQueue, create_request_queue

# Output tokens a request reserves at most before its key has a finished request to go by.
MAX_RESERVED_OUTPUT = 256
_MEAN_DECAY = 0.8  # the mean output of a key's finished requests: an exponential mean


@dataclass(slots=True)
class KeyState:
    counter: float = 0.0  # virtual tokens: weighted tokens served / weight
    weight: float = 1.0  # the latest request's weight
    num_waiting: int = 0
    num_unfinished: int = 0  # waiting or running
    reserved: float = 0.0  # weighted tokens its running requests are expected to make yet
    mean_output: float | None = None  # output tokens of its finished requests, on average

    @property
    def virtual(self) -> float:
        """What the orders read: served and reserved, per unit of weight."""
        return self.counter + self.reserved / self.weight


@dataclass(slots=True)
class ServedTokens:
    """Tokens served to one key since the last `drain_served` (unweighted)."""

    prompt: int = 0
    output: int = 0


class VirtualTokenCounter:
    """The counters of every key with unfinished requests (and of idle keys that are ahead)."""

    def __init__(self, prompt_weight: float = 1.0, output_weight: float = 2.0) -> None:
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self.keys: dict[str, KeyState] = {}
        # The counter of the last key to go idle (or higher): where a key arriving at an
        # engine with no unfinished requests starts.
        self._idle_level = 0.0
        self._prompt_charged: dict[str, int] = {}  # request id -> prompt tokens charged
        self._reserved: dict[str, float] = {}  # request id -> weighted output cost reserved
        self._served: dict[str, ServedTokens] = {}

    # ---- requests come and go -----------------------------------------------------------

    def on_added(self, request: Request) -> KeyState:
        """A new request (not a preempted one coming back) joins the waiting queue."""
        key = request.fairness_key
        state = self.keys.get(key)
        if state is None:
            state = self.keys[key] = KeyState()
        state.weight = request.fairness_weight
        if state.num_waiting == 0:  # returning from idle (or from only running requests)
            floor = self._floor(exclude=key)
            if state.num_unfinished:
                # Still running: a client that sends its next request when one ends is
                # backlogged, though its queue was empty for a moment. It keeps a lag of up
                # to one request's cost per request it has in the engine (what admitting
                # whole requests leaves), not more.
                floor -= state.num_unfinished * self._expected_cost(request, state) / state.weight
            state.counter = max(state.counter, floor - state.reserved / state.weight)
        state.num_unfinished += 1
        return state

    def _expected_output(self, request: Request, state: KeyState) -> float:
        """The output tokens `request` is expected to make yet: its remaining max_tokens,
        at most its key's mean output (or MAX_RESERVED_OUTPUT before it has one)."""
        max_tokens = request.max_tokens
        if not max_tokens:
            return 0.0
        limit = state.mean_output if state.mean_output is not None else MAX_RESERVED_OUTPUT
        return max(0.0, min(float(max_tokens - request.num_output_tokens), limit))

    def _expected_cost(self, request: Request, state: KeyState) -> float:
        output = self.output_weight * self._expected_output(request, state)
        return self.prompt_weight * request.num_prompt_tokens + output

    def on_finished(self, request: Request) -> None:
        """The request finished (stopped, capped or aborted) and left the scheduler."""
        self._prompt_charged.pop(request.request_id, None)
        self.on_preempted(request)  # releases what it still held in reserve
        state = self.keys.get(request.fairness_key)
        if state is None:
            return
        if request.sampling_params is not None:
            num_output = request.num_output_tokens
            mean = state.mean_output
            state.mean_output = (
                num_output if mean is None else _MEAN_DECAY * mean + (1 - _MEAN_DECAY) * num_output
            )
        state.num_unfinished -= 1
        if state.num_unfinished > 0:
            return
        self._idle_level = max(self._idle_level, state.virtual)
        if state.virtual <= self._floor(exclude=request.fairness_key):
            del self.keys[request.fairness_key]  # nothing it would keep on return

    def _floor(self, exclude: str) -> float:
        """Where a key returning from idle starts: the smallest counter of the backlogged
        keys, else of the keys with running requests, else the idle level."""
        backlogged = [s.virtual for k, s in self.keys.items() if s.num_waiting and k != exclude]
        if backlogged:
            return min(backlogged)
        active = [s.virtual for k, s in self.keys.items() if s.num_unfinished and k != exclude]
        return min(active) if active else self._idle_level

    # ---- reserving ----------------------------------------------------------------------

    def on_admitted(self, request: Request) -> None:
        """The request leaves the waiting queue for the batch: it reserves the output it is
        expected to make (weighted), which its key's place in the orders counts at once."""
        state = self.keys.get(request.fairness_key)
        if state is None:
            return
        cost = self.output_weight * self._expected_output(request, state)
        if not cost:
            return
        self._reserved[request.request_id] = cost
        state.reserved += cost

    def on_preempted(self, request: Request) -> None:
        """The request left the batch (preempted, or ended): its reserve is released."""
        cost = self._reserved.pop(request.request_id, 0.0)
        state = self.keys.get(request.fairness_key)
        if cost and state is not None:
            state.reserved = max(0.0, state.reserved - cost)

    def _consume_reserve(self, request: Request, cost: float) -> None:
        held = self._reserved.get(request.request_id)
        if not held:
            return
        used = min(held, cost)
        self._reserved[request.request_id] = held - used
        state = self.keys.get(request.fairness_key)
        if state is not None:
            state.reserved = max(0.0, state.reserved - used)

    # ---- charging -----------------------------------------------------------------------

    def on_scheduled(self, request: Request, num_new_tokens: int) -> None:
        """A step computes `num_new_tokens` of the request from `num_computed_tokens` on:
        charges the prompt positions among them that were never charged before."""
        start = max(request.num_computed_tokens, self._prompt_charged.get(request.request_id, 0))
        end = min(request.num_computed_tokens + num_new_tokens, request.num_prompt_tokens)
        if end <= start:
            return
        self._prompt_charged[request.request_id] = end
        self._charge(request.fairness_key, end - start, 0)

    def on_output(self, request: Request, num_output_tokens: int) -> None:
        """Output tokens delivered: charged, and taken from the request's reserve."""
        if num_output_tokens > 0:
            self._charge(request.fairness_key, 0, num_output_tokens)
            self._consume_reserve(request, self.output_weight * num_output_tokens)

    def on_one_output_each(self, requests: list[Request]) -> None:
        """`on_output(request, 1)` for each request in turn, the same operations in the
        same order, in one call: the decode fast path (engine/core/plain_decode.py)
        charges every row of a step."""
        keys, reserved, output_weight = self.keys, self._reserved, self.output_weight
        key: str | None = None
        state: KeyState | None = None
        served = ServedTokens()
        for request in requests:
            if request.fairness_key != key:
                key = request.fairness_key
                state = keys.get(key)
                served = self._served.get(key)  # type: ignore[assignment]
                if served is None:
                    served = self._served[key] = ServedTokens()
            if state is not None:
                state.counter += output_weight / state.weight  # 0 prompt + 1 output token
            served.output += 1
            held = reserved.get(request.request_id)
            if held:
                used = min(held, output_weight)
                reserved[request.request_id] = held - used
                if state is not None:
                    state.reserved = max(0.0, state.reserved - used)

    def _charge(self, key: str, num_prompt: int, num_output: int) -> None:
        state = self.keys.get(key)
        if state is not None:
            cost = self.prompt_weight * num_prompt + self.output_weight * num_output
            state.counter += cost / state.weight
        served = self._served.get(key)
        if served is None:
            served = self._served[key] = ServedTokens()
        served.prompt += num_prompt
        served.output += num_output

    def drain_served(self) -> dict[str, ServedTokens]:
        """The tokens served per key since the last call (for the metrics)."""
        served, self._served = self._served, {}
        return served

    def counter(self, key: str) -> float:
        """The key's virtual counter (served and reserved, per unit of weight)."""
        state = self.keys.get(key)
        return state.virtual if state is not None else self._floor(exclude=key)

    # ---- orders -------------------------------------------------------------------------

    def order_running(self, running: list[Request]) -> None:
        """Sorts the running requests by their key's counter, keeping the policy's order
        within a key (a stable sort); one key: nothing moves."""
        if len(self.keys) > 1:
            running.sort(key=lambda r: self.counter(r.fairness_key))


def policy_order(policy: str, request: Request) -> tuple[float, ...]:
    """A request's place under the policy alone (fcfs: arrival; priority: priority first)."""
    if policy == "priority":
        return (-request.priority, request.arrival_time)
    return (request.arrival_time,)


class FairQueue(RequestQueue):
    """The waiting queue under VTC: one policy queue per key; `peek`/`pop` take the head of
    the backlogged key the counter says goes next."""

    def __init__(self, policy: str, vtc: VirtualTokenCounter) -> None:
        self.policy = policy
        self.vtc = vtc
        self._queues: dict[str, RequestQueue] = {}
        self._len = 0

    def _queue(self, key: str) -> RequestQueue:
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = create_request_queue(self.policy)
        return queue

    def _put(self, request: Request, preempted: bool) -> None:
        state = self.vtc.keys.get(request.fairness_key)
        queue = self._queue(request.fairness_key)
        if preempted:
            queue.add_preempted(request)
        else:
            queue.add(request)
        if state is not None:
            state.num_waiting += 1
        self._len += 1

    def add(self, request: Request) -> None:
        self.vtc.on_added(request)
        self._put(request, preempted=False)

    def add_preempted(self, request: Request) -> None:
        self._put(request, preempted=True)

    def _next_key(self) -> str:
        best_key, best = None, None
        for key, queue in self._queues.items():
            if not queue:
                continue
            state = self.vtc.keys[key]
            rank = (state.virtual, state.num_waiting, policy_order(self.policy, queue.peek()))
            if best is None or rank < best:
                best_key, best = key, rank
        if best_key is None:
            raise IndexError("peek from an empty queue")
        return best_key

    def peek(self) -> Request:
        return self._queues[self._next_key()].peek()

    def pop(self) -> Request:
        key = self._next_key()
        request = self._queues[key].pop()
        self._taken(key)
        return request

    def remove(self, request: Request) -> None:
        self._queues[request.fairness_key].remove(request)
        self._taken(request.fairness_key)

    def _taken(self, key: str) -> None:
        self._len -= 1
        state = self.vtc.keys.get(key)
        if state is not None:
            state.num_waiting -= 1
        if not self._queues[key]:
            del self._queues[key]

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        for queue in list(self._queues.values()):
            yield from queue


def create_waiting_queue(policy: str, fairness: str, vtc: VirtualTokenCounter) -> RequestQueue:
    """The scheduler's waiting queue: fair across keys under "vtc", the plain policy queue
    under "off"."""
    if fairness == "vtc":
        return FairQueue(policy, vtc)
    if fairness == "off":
        return create_request_queue(policy)
    raise ValueError(f"fairness must be 'vtc' or 'off', got {fairness!r}.")
