"""The scheduler's fast path for plain decode rows (issue 42: the host's time per step).

Most rows of a decode step at a large batch are *plain*: a running request past its prompt
that computes one token whose cache slot lies inside its last block without filling it,
and (in `update`) samples one token with no drafts and no grammar. For such a row the
general path's work reduces to a few integer compares; this module does exactly that and
hands every other row back to the general path, row by row, so the result is the same
(vLLM v1 gets the same effect from its persistent batch)::

    block_size = 4, block_table = [7, 2]        tokens t0..t5 known, t0..t4 computed

    step computes t5 (position 5):  slot 9 in block 2, which has room after it
                                    -> plain: no allocation, nothing becomes full
    step computes t7 (position 7):  fills block 2 -> plain, and block 2 is published
                                    (put in the prefix cache) as allocate_slots would
    step computes t8 (position 8):  needs a new block -> general path

The schedule side needs no rope regime that may force a recompute, no n-gram proposer and
no sliding window (each makes every row's step its own case); the scheduler builds a
`PlainDecode` only when none applies. The update side applies to every engine.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.core.fairness import VirtualTokenCounter
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.sched_output import ScheduledRequest
from engine.core.stop import check_stop, stop_screen

_PREEMPTED = RequestStatus.PREEMPTED


class PlainDecode:
    """Schedules the plain decode rows of a step's running requests."""

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.block_size = kv_cache_manager.block_size
        # request id -> its block table as ids (read only here; the manager keeps it).
        self._block_ids = kv_cache_manager.block_id_tables()
        self._publish = kv_cache_manager.cache_full_blocks

    def schedule(
        self,
        running: list[Request],
        index: int,
        budget: int,
        scheduled: list[ScheduledRequest],
        max_scheduled: int,
    ) -> int:
        """Schedules `running[index:]` up to the first row that is not plain (or the
        budget, or `max_scheduled` entries); returns the index of that first row. Each row
        takes one token of the budget (the caller subtracts `returned - index`)."""
        block_size = self.block_size
        tables = self._block_ids
        stop = min(len(running), index + budget, index + max_scheduled - len(scheduled))
        append = scheduled.append
        publish = self._publish
        while index < stop:
            request = running[index]
            num_computed = request.num_computed_tokens
            if (
                len(request.all_token_ids) != num_computed + 1
                or num_computed < len(request.prompt_token_ids)  # a prompt token: charged
            ):
                break
            ids = tables.get(request.request_id)
            if ids is None or num_computed >= len(ids) * block_size:  # needs a block
                break
            if (num_computed + 1) % block_size == 0:  # fills its last block: published
                publish(request, num_computed + 1)
            append(
                ScheduledRequest(request, num_computed, 1, ids.copy(), [], request.num_preemptions)
            )
            index += 1
        return index


def update_plain_rows(
    entries: list[ScheduledRequest],
    sampled: dict[str, int],
    now: float,
    fairness: VirtualTokenCounter,
    max_model_len: int,
    updated: list[Request],
    general: Callable[[ScheduledRequest], None],
    finish: Callable[[Request, RequestStatus], None],
) -> int:
    """`Scheduler.update` over the step's entries, in order: a plain row (one sampled
    token, no drafts, no grammar) is done here (the token appended, its key charged, the
    stop conditions checked in full only where one can fire: the length cap reached or a
    stop token id sampled; `finish` for one that stops); any other live row goes to
    `general`, which appends to `updated` itself. Returns the plain rows' tokens."""
    num_tokens = 0
    # Rows whose token is not charged yet: charged in one call before anything else
    # touches the counters (a finish, a general row) and at the end, so the counters see
    # the same operations in the same order as one charge per row.
    charged: list[Request] = []
    for entry in entries:
        request = entry.request
        if request.status > _PREEMPTED:  # aborted while the step ran
            continue
        if request.num_preemptions != entry.num_preemptions:
            continue  # preempted while its step was in flight: it recomputes later
        token_id = None
        if not request.spec_token_ids and request.structured_output is None:
            token_id = sampled.get(request.request_id)
        if token_id is None:
            fairness.on_one_output_each(charged)
            charged.clear()
            general(entry)
            continue
        times = request.times
        if times.first_token_time is None:
            times.first_token_time = now
        times.last_token_time = now
        request.output_token_ids.append(token_id)
        request.all_token_ids.append(token_id)
        num_tokens += 1
        charged.append(request)
        screen = request.stop_screen
        if screen is None:
            screen = request.stop_screen = stop_screen(request, max_model_len)
        if len(request.output_token_ids) >= screen[0] or token_id in screen[1]:
            status = check_stop(request, max_model_len)
            if status is not None:
                fairness.on_one_output_each(charged)
                charged.clear()
                finish(request, status)
        updated.append(request)
    fairness.on_one_output_each(charged)
    return num_tokens
