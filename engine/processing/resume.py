"""Resuming a request on this engine with output tokens generated elsewhere.

When the engine replica holding a stream dies, stalls or drains, the tokenizer service
resubmits the request to another replica with the prompt and, per output, the tokens
already generated. The engine takes those tokens as *output*, not prompt, so that the rest
of the request goes exactly as if it had never moved:

    add_request(request_id, prompt, params, resumed_output_token_ids={0: [t0, t1, ...]})
        -> one Request per listed output index, built with output_token_ids=[t0, t1, ...]

- max_tokens / min_tokens count them; the stop checks (stop ids, EOS, stop strings) look
  only at what comes after them (a stop string that begins in them and ends in a new token
  still matches, as it would have);
- presence / frequency / repetition penalties, bad words and logits processors see them as
  output;
- the counter-based sampler (engine/sample/rng.py) draws the token at output position p with
  uniform(seed, p), and p is the number of output tokens so far: a seeded request continues
  at the same position, so greedy and seeded requests produce the same tokens;
- their logprobs are not recomputed (they were delivered before the move), nor are prompt
  logprobs (delivered with the first token, before any move could happen);
- the prefix cache reuses whatever of prompt + resumed tokens this engine holds (the
  scheduler's recompute-after-preemption path: `num_computed_tokens` starts at the hit);
- a structured-output grammar is advanced over them before the request is scheduled.

n > 1: the mapping's keys are the output indices that continue; an index left out is
finished (or was never asked for) and produces nothing here. Each continuing output keeps
its index, so its sample id and its seed (`seed + index`) are the ones it had.

The engine's request outputs then report the whole output: in CUMULATIVE mode `token_ids`
and `text` include the resumed tokens; in DELTA mode the first delta starts after them
(with any text the first engine held back as a possible stop-string start). `logprobs`
and `cumulative_logprob` cover only the tokens generated here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from engine.api.sampling_params import SamplingParams

# add_request's argument: output index -> the tokens that output has generated so far.
ResumedOutputTokenIds = Mapping[int, Sequence[int]]

FIELD = "resumed_output_token_ids"


def check_resumed_output_token_ids(
    resumed: object,
    params: SamplingParams,
    num_prompt_tokens: int,
    *,
    vocab_size: int,
    max_model_len: int,
    max_tokens_in_cache: int,
) -> dict[int, list[int]]:
    """The caller's mapping, checked and copied (sorted by index).

    Raises TypeError / ValueError naming `resumed_output_token_ids` (and the index) when an
    index is not one of the request's n outputs, a token is outside the vocabulary, or an
    output could not generate one more token: it already has max_tokens tokens, or prompt +
    output reach max_model_len or the whole KV cache. Such an output is finished; the
    caller must not resubmit it.
    """
    if not isinstance(resumed, Mapping):
        raise TypeError(
            f"{FIELD} must map output indices to token id lists, got {type(resumed).__name__}."
        )
    if not resumed:
        raise ValueError(f"{FIELD} must list at least one output to continue.")
    for index in resumed:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < params.n:
            raise ValueError(
                f"{FIELD}[{index!r}]: the key must be an output index in [0, n={params.n})."
            )
    checked: dict[int, list[int]] = {}
    for index in sorted(resumed):
        name = f"{FIELD}[{index}]"
        token_ids = resumed[index]
        if not isinstance(token_ids, Sequence) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise TypeError(f"{name} must be a list of ints.")
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"{name} holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}."
            )
        checked[index] = list(token_ids)
        _check_room(name, len(token_ids), params, num_prompt_tokens, max_model_len)
        _check_cache(name, len(token_ids) + num_prompt_tokens, max_tokens_in_cache)
    return checked


def _check_room(
    name: str, num_output: int, params: SamplingParams, num_prompt: int, max_model_len: int
) -> None:
    if params.max_tokens is not None and num_output >= params.max_tokens:
        raise ValueError(
            f"{name} holds {num_output} tokens, max_tokens={params.max_tokens}: that output "
            "is finished and cannot continue."
        )
    if num_prompt + num_output >= max_model_len:
        raise ValueError(
            f"{name}: the prompt ({num_prompt} tokens) and {num_output} output tokens reach "
            f"the maximum model length of {max_model_len} (max_model_len): that output is "
            "finished and cannot continue."
        )


def _check_cache(name: str, num_tokens: int, max_tokens_in_cache: int) -> None:
    """One more token than prompt + output must fit the whole cache (else it is 'length')."""
    if num_tokens >= max_tokens_in_cache:
        raise ValueError(
            f"{name}: the prompt and output ({num_tokens} tokens) fill the whole KV cache "
            f"({max_tokens_in_cache} tokens): that output cannot continue here."
        )
