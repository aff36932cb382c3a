"""Outputs that waited for their consumer, merged into one (vLLM's `RequestOutputCollector`).

The engine thread puts one `RequestOutput` per step into a request's stream; a consumer that
is behind (its event loop busy, its client slow) finds several queued. It then gets them as
one output carrying everything produced since its last read, so a slow consumer makes fewer,
fuller messages instead of falling further behind one step at a time:

    DELTA       step k: [t5]  step k+1: [t6]  step k+2: [t7, finish]
                   ──▶ one output: [t5, t6, t7], logprobs concatenated, finish of the last
    CUMULATIVE  each output already holds everything: the latest one stands for all
    FINAL_ONLY  only one output is ever sent

Per output index the tokens keep their order; an index that changed in only one of the
merged steps keeps its place. A consumer that keeps up sees one output per step, as before.
"""

from __future__ import annotations

import dataclasses

from engine.api.outputs import CompletionOutput, RequestOutput
from engine.api.sampling_params import RequestOutputKind


def merge_outputs(
    first: RequestOutput, later: RequestOutput, kind: RequestOutputKind
) -> RequestOutput:
    """`first` followed by `later` (the same request) as one output of `kind`. Neither is
    modified: the engine thread may still hold the lists they were built from."""
    if kind != RequestOutputKind.DELTA:
        return later
    completions = {c.index: c for c in first.outputs}
    for completion in later.outputs:
        earlier = completions.get(completion.index)
        completions[completion.index] = (
            completion if earlier is None else _merge_completions(earlier, completion)
        )
    prompt_logprobs = first.prompt_logprobs
    if later.prompt_logprobs:
        prompt_logprobs = (prompt_logprobs or []) + later.prompt_logprobs
    return dataclasses.replace(
        later, outputs=list(completions.values()), prompt_logprobs=prompt_logprobs
    )


def _merge_completions(first: CompletionOutput, later: CompletionOutput) -> CompletionOutput:
    logprobs = first.logprobs
    if later.logprobs is not None:
        logprobs = (logprobs or []) + later.logprobs
    return dataclasses.replace(
        later,
        text=first.text + later.text,
        token_ids=first.token_ids + later.token_ids,
        logprobs=logprobs,
    )
