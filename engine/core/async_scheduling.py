"""Async scheduling: the scheduler's placeholder bookkeeping and when a step may overlap.

With `async_scheduling` the engine schedules and submits step N+1 before it collects step
N (engine/front/llm_engine.py), so the host prepares N+1 while the device runs N::

    host    schedule N | launch N | schedule N+1 | launch N+1 | finish N, update N | ...
    device             |  ======= step N ======= |  ======= step N+1 ======= |

Every request that samples in step N is scheduled again in step N+1 with one placeholder
token: the token N samples, unknown to the host until N is collected. Its KV slot is
allocated as for any token; the runner fills the row's input id on the device from N's
sampled ids (engine/worker/placeholder_inputs.py); its position and slot are known here.
`Request.num_output_placeholders` counts a request's tokens in flight: `mark_placeholders`
adds one per sampling entry as a step is scheduled, `Scheduler.update` removes it as the
token arrives, a preemption resets it (the in-flight token is dropped and recomputed).

A request that finishes at step N (EOS, max_tokens, a stop string, an abort) is freed when
N is collected; its step N+1 row is then dropped by `Scheduler.update` (the request is
finished), so the token is never emitted and the blocks are freed once. Step N+1 is not
given rows that surely finish at N (max_tokens or max_model_len reached by N's token).

When a step falls back (`overlap_blocker`): the engine collects step N before it
schedules N+1 when a request that samples in N needs its tokens on the host first:
- structured outputs: the next step's grammar bitmask follows the token N samples;
- speculative (n-gram) decoding: drafts are proposed from the tokens so far, every step;
- bad words, logits processors and min_tokens: the sampler reads the output so far from
  the host; penalties too on the CPU (on an accelerator their counts are kept on the
  device across steps: engine/sample/penalty_state.py, `penalties_on_device`);
- prompt logprobs and pooling requests: they read more from the device than the step's
  one copy (each their own read), so nothing would overlap anyway.
Plain greedy and seeded sampling (top-k/p, min-p, logprobs, logit bias, allowed ids,
LoRA, n > 1, and presence/frequency/repetition penalties counted on the device) overlap.
The seeded sampler's position counts the placeholders (`SamplingRow.num_output_placeholders`;
the slots' positions in engine/sample/sampling_slots.py), so seeded tokens are the same both
ways.
"""

from __future__ import annotations

from engine.config.parallel import ParallelConfig
from engine.core.request import Request
from engine.core.sched_output import ScheduledRequest, SchedulerOutput


def unsupported_reason(parallel_config: ParallelConfig) -> str | None:
    """Why async scheduling cannot run with this engine's layout, or None.

    Pipeline parallelism already keeps several batches in flight, one request in at most
    one of them: a placeholder would need the sampled ids to cross from the last stage to
    the first. Rank processes (tensor parallelism) send the step's inputs as deltas built
    from the host's tokens (engine/executor/step_delta.py), which a placeholder lacks."""
    if parallel_config.pipeline_parallel_size > 1:
        return "pipeline_parallel_size > 1 keeps its own batches in flight"
    if parallel_config.world_size > 1 or parallel_config.distributed_executor_backend == "mp":
        return "rank processes take the step's token ids from the host"
    return None


def num_tokens_to_schedule(request: Request, max_model_len: int) -> int:
    """The tokens a running request still lacks, placeholders counted; 0 when a token in
    flight surely finishes it (its max_tokens or max_model_len reached)."""
    num_placeholders = request.num_output_placeholders
    if num_placeholders:
        max_tokens = request.max_tokens
        if max_tokens is not None and request.num_output_tokens + num_placeholders >= max_tokens:
            return 0
        if request.num_tokens + num_placeholders >= max_model_len:
            return 0
    return request.num_tokens + num_placeholders - request.num_computed_tokens


def mark_placeholders(scheduled: list[ScheduledRequest]) -> None:
    """After a step is scheduled: records each entry's placeholder inputs (the request's
    tokens in flight) and counts its own sampled token as one more placeholder."""
    for entry in scheduled:
        request = entry.request
        entry.num_placeholder_inputs = request.num_output_placeholders
        if entry.samples and not entry.spec_token_ids:
            request.num_output_placeholders += 1
            entry.adds_placeholder = True


def count_arrivals(scheduled: list[ScheduledRequest]) -> None:
    """Before a step's update: each live entry that added a placeholder has its token now
    (an aborted request needs no count; a preempted one had its count reset)."""
    for entry in scheduled:
        if entry.adds_placeholder:
            request = entry.request
            if request.is_finished() or request.num_preemptions != entry.num_preemptions:
                continue
            request.num_output_placeholders -= 1


def overlap_blocker(
    step: SchedulerOutput, speculative: bool, penalties_on_device: bool = False
) -> str | None:
    """Why the step after `step` cannot be scheduled before `step` is collected (the
    module's list), or None when it can. `penalties_on_device`: the runner counts the
    penalties' tokens on the device (engine/sample/sampling_slots.py decides)."""
    if speculative:
        return "speculative decoding proposes drafts from the tokens on the host"
    for entry in step.scheduled:
        request = entry.request
        if request.is_pooling:
            return "a pooling request"
        params = request.sampling_params
        if params is None:
            continue
        if (
            params.prompt_logprobs is not None
            and entry.num_computed_tokens + 1 < request.num_prompt_tokens
        ):
            return "prompt logprobs"
        if not entry.samples:
            continue
        if request.structured_output is not None:
            return "structured outputs"
        if entry.spec_token_ids:
            return "draft tokens"
        penalised = (
            params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0
        )
        if (
            (penalised and not penalties_on_device)
            or params.bad_words_token_ids
            or params.logits_processors
        ):
            return "a sampling parameter that reads the output so far"
        if request.num_output_tokens < params.min_tokens:
            return "min_tokens not yet reached"
    return None
