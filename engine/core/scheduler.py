"""Continuous batching by token budget.

Every request has `num_computed_tokens`; a step grants each scheduled request some of the
tokens it still lacks (a prefill chunk, or the one decode token), within
`max_num_batched_tokens` and `max_num_seqs`. Prefill and decode share one batch, and the
same rule covers chunked prefill, prefix-cache hits and recompute after preemption.

Order within a step: running requests first (priority order under the priority policy,
arrival order under FCFS; under fairness "vtc", first by their fairness key's virtual token
counter, see fairness.py), then waiting ones (under "vtc", the next one comes from the
backlogged key served least); with LoRA, a waiting request whose adapter
would be one more than `max_loras` among the running requests waits (head of the queue).
When a running request cannot get a block, the running request that comes *last* in that
order (so, under "vtc", of the key most ahead of its share) is preempted (its blocks
freed, its state reset to recompute later). Because already-scheduled requests come
earlier in the order, a victim is never one that was scheduled in this step, except the
request itself.

With speculative decoding (n-gram drafts), an eligible running request in decode gets
`1 + k` tokens: its last known token and k drafts kept in `request.spec_token_ids`. The
drafts are only ever dropped, never the cause of a preemption. `update` appends the tokens
the runner verified and rolls `num_computed_tokens` back over the rejected drafts, whose
cache slots the next step overwrites.

Plain decode rows (one token in the last block's room, one sampled token) take a fast path
with the same outcome (plain_decode.py); every other row goes through the code here, its
tokens taken and appended by step_tokens.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from engine.config.resolved import SchedulerConfig
from engine.config.speculative import SpeculativeConfig
from engine.core import async_scheduling
from engine.core.fairness import VirtualTokenCounter, create_waiting_queue
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.ngram_proposer import NgramProposer, can_speculate
from engine.core.plain_decode import PlainDecode, update_plain_rows
from engine.core.request import Request, RequestStatus
from engine.core.sched_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.core.step_tokens import append_tokens, step_token_ids


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.fairness = VirtualTokenCounter(
            config.fairness_prompt_token_weight, config.fairness_output_token_weight
        )
        self.waiting = create_waiting_queue(config.policy, config.fairness, self.fairness)
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()  # since the last schedule(), for the runner
        self.num_preemptions_total = 0
        self.proposer = NgramProposer(speculative_config) if speculative_config else None
        # Drafts scheduled / accepted since start; output tokens appended by the last update.
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self.num_output_tokens_last_update = 0
        self._max_scheduled = config.max_num_seqs  # this step's cap (see schedule)
        # Async scheduling's placeholders (engine/core/async_scheduling.py); set by the engine.
        self.async_scheduling = False
        # The plain decode rows' fast path (plain_decode.py); none where a rope regime, the
        # proposer or a sliding window makes each row's step its own case.
        self._plain = (
            PlainDecode(kv_cache_manager)
            if kv_cache_manager.rope is None
            and self.proposer is None
            and kv_cache_manager.sliding_window is None
            else None
        )

    # ---- queue management -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the scheduler.")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finishes (e.g. aborts) requests at any point; unknown ids are ignored."""
        assert RequestStatus.is_finished(status)
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)

    def _free(self, request: Request) -> None:
        request.times.finished_time = time.time()
        self.fairness.on_finished(request)
        self.kv_cache_manager.free(request)
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    # ---- schedule ---------------------------------------------------------------------

    def schedule(self, max_scheduled_seqs: int | None = None) -> SchedulerOutput:
        """The next step. `max_scheduled_seqs` caps the requests in it: with pipeline
        parallelism the engine splits the live requests over the batches in flight, so
        that the stages overlap (vLLM's virtual engines)."""
        self._max_scheduled = max_scheduled_seqs or self.config.max_num_seqs
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: set[str] = set()
        if self.config.policy == "priority":
            self.running.sort(key=lambda r: (-r.priority, r.arrival_time))
        if self.config.fairness == "vtc":
            self.fairness.order_running(self.running)

        index = 0
        while index < len(self.running) and budget > 0 and len(scheduled) < self._max_scheduled:
            if self._plain is not None:
                start = index
                index = self._plain.schedule(
                    self.running, index, budget, scheduled, self._max_scheduled
                )
                budget -= index - start
                full = not budget or len(scheduled) >= self._max_scheduled
                if full or index == len(self.running):
                    break  # else running[index] is not a plain row: the general path's
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if request.num_output_placeholders:  # async scheduling: a token in flight
                num_new = min(
                    async_scheduling.num_tokens_to_schedule(request, self.config.max_model_len),
                    budget,
                )
            if num_new <= 0:  # its last step is still in flight (pipeline parallelism)
                index += 1
                continue
            rope = self.kv_cache_manager.rope
            if rope is not None and rope.must_recompute(request.rope_length, request.num_tokens):
                # Longrope past its threshold: every K/V again, with the long factors (as
                # transformers' Phi-3 generation does), through a recomputing preemption.
                self.running.pop(index)
                self._preempt(request)
                preempted.add(request.request_id)
                continue
            drafts = self._propose(request, budget)
            num_new += len(drafts)
            while self.kv_cache_manager.allocate_slots(request, num_new) is None:
                if drafts:  # speculation never preempts: retry without the drafts
                    num_new -= len(drafts)
                    drafts = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            else:
                request.spec_token_ids = drafts
                self.num_draft_tokens += len(drafts)
                scheduled.append(self._entry(request, num_new))
                budget -= num_new
                index += 1

        # Waiting requests only when nothing was preempted: a preemption means the cache
        # is full, and admitting new work would only preempt again.
        if not preempted:
            budget = self._schedule_waiting(scheduled, budget)

        for entry in scheduled:
            entry.request.num_computed_tokens += entry.num_new_tokens
        if self.async_scheduling:
            async_scheduling.mark_placeholders(scheduled)
        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            finished_request_ids=finished,
            preempted_request_ids=preempted,
        )

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        """Admits waiting requests in queue order; one whose grammar is still compiling is
        passed over (and keeps its place) so that it holds up nobody."""
        not_ready: list[Request] = []
        try:
            return self._admit_waiting(scheduled, budget, not_ready)
        finally:
            for request in reversed(not_ready):
                self.waiting.add_preempted(request)  # back at the front, in order

    def _admit_waiting(
        self, scheduled: list[ScheduledRequest], budget: int, not_ready: list[Request]
    ) -> int:
        now = time.time()
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(scheduled) < self._max_scheduled
        ):
            request = self.waiting.peek()
            if not request.is_ready():
                not_ready.append(self.waiting.pop())
                continue
            if self._too_many_loras(request):  # it waits until an adapter's requests end
                break
            self._set_rope_length(request)
            if request.needs_all_prompt_positions:
                hit_blocks, num_hit = [], 0
            else:
                hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new, hit_blocks, num_hit)
            if new_blocks is None:
                break
            self.waiting.pop()
            self.fairness.on_admitted(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if request.times.first_scheduled_time is None:
                request.times.first_scheduled_time = now
            self.running.append(request)
            scheduled.append(self._entry(request, num_new))
            budget -= num_new
        return budget

    def _set_rope_length(self, request: Request) -> None:
        """The rope length of a request about to be computed from scratch (RopeRegime); its
        block hashes follow a change (they carry the regime)."""
        rope = self.kv_cache_manager.rope
        if rope is None:
            return
        length = rope.admission_length(request.num_prompt_tokens, request.num_tokens)
        if length != request.rope_length:
            request.rope_length = length
            request.block_hashes.clear()

    def _too_many_loras(self, request: Request) -> bool:
        """Admitting `request` would put more than `max_loras` distinct adapters among the
        running requests (the runner's adapter slots per batch)."""
        max_loras, lora = self.config.max_loras, request.lora_request
        if max_loras is None or lora is None:
            return False
        active = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        return lora.lora_int_id not in active and len(active) >= max_loras

    def _propose(self, request: Request, budget: int) -> list[int]:
        """N-gram drafts for an eligible request in decode; none that would pass the step's
        budget, max_tokens or max_model_len (the step adds up to 1 + len(drafts) tokens)."""
        if self.proposer is None or not can_speculate(request):
            return []
        limit = min(budget, self.config.max_model_len - request.num_tokens) - 1
        max_tokens = request.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - request.num_output_tokens - 1)
        if limit <= 0:
            return []
        return self.proposer.propose(request.all_token_ids, limit)

    def _entry(self, request: Request, num_new: int) -> ScheduledRequest:
        """The step's entry for `request`, its prompt tokens charged to its key."""
        self.fairness.on_scheduled(request, num_new)
        return ScheduledRequest(
            request=request,
            num_computed_tokens=request.num_computed_tokens,
            num_new_tokens=num_new,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            spec_token_ids=list(request.spec_token_ids),
            num_preemptions=request.num_preemptions,
        )

    def _preempt(self, request: Request) -> None:
        self.fairness.on_preempted(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_output_placeholders = 0  # their tokens are dropped and recomputed
        request.num_preemptions += 1
        request.times.preemption_times.append(time.time())
        self.num_preemptions_total += 1
        self.waiting.add_preempted(request)

    # ---- update -----------------------------------------------------------------------

    def update(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Appends sampled tokens, finishes requests that stop (and pooling requests that
        were pooled), frees their blocks.

        Returns the requests that produced something this step (a token, prompt logprobs or
        a pooled vector), finished ones included, in scheduling order.
        """
        now = time.time()
        updated: list[Request] = []

        def general(entry: ScheduledRequest) -> None:
            self._update_entry(entry, runner_output, now, updated)

        self.num_output_tokens_last_update = 0  # the general path counts its own
        if self.async_scheduling:  # the tokens in flight of this step arrived
            async_scheduling.count_arrivals(output.scheduled)
        num_plain_tokens = update_plain_rows(
            output.scheduled,
            runner_output.sampled_token_ids,
            now,
            self.fairness,
            self.config.max_model_len,
            updated,
            general,
            self._finish,
        )
        self.num_output_tokens_last_update += num_plain_tokens
        return updated

    def _update_entry(
        self,
        entry: ScheduledRequest,
        runner_output: ModelRunnerOutput,
        now: float,
        updated: list[Request],
    ) -> None:
        """`update` for a live entry that is not a plain row: drafts, a grammar, pooling,
        prompt logprobs only, or nothing sampled."""
        request = entry.request
        token_ids, num_accepted = step_token_ids(request, runner_output)
        self.num_accepted_draft_tokens += num_accepted
        if request.request_id in runner_output.pooled:
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            updated.append(request)
            return
        if not token_ids:
            if request.request_id in runner_output.prompt_logprobs:
                updated.append(request)
            return
        if request.times.first_token_time is None:
            request.times.first_token_time = now
        request.times.last_token_time = now
        num_output = request.num_output_tokens
        status = append_tokens(request, token_ids, self.config.max_model_len)
        num_appended = request.num_output_tokens - num_output
        self.num_output_tokens_last_update += num_appended
        self.fairness.on_output(request, num_appended)
        if status is not None:
            self._finish(request, status)
        updated.append(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """A running request stopped (or was pooled): out of the batch, its blocks freed."""
        self.running.remove(request)
        request.status = status
        self._free(request)
