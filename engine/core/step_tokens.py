"""The tokens a step gives one request, and their appending (the scheduler's general
update path; plain decode rows take plain_decode.py's).

    step_token_ids   none, the one sampled token, or a verified run of drafts plus one
                     (the rejected drafts' computed tokens rolled back)
    append_tokens    one by one, each checked for a stop (stop.py) and by the request's
                     grammar; the tokens after the one that finishes it are dropped
"""

from __future__ import annotations

from engine.core.request import Request, RequestStatus
from engine.core.sched_output import ModelRunnerOutput
from engine.core.stop import check_stop


def step_token_ids(request: Request, runner_output: ModelRunnerOutput) -> tuple[list[int], int]:
    """The tokens the step produced for `request` (none, one, or a verified draft run
    plus one) and how many drafts were accepted; for a speculative entry, rolls
    `num_computed_tokens` back over the rejected drafts (their slots hold keys/values of
    wrong tokens) and clears them."""
    num_drafts = len(request.spec_token_ids)
    if not num_drafts:
        token_id = runner_output.sampled_token_ids.get(request.request_id)
        return ([] if token_id is None else [token_id]), 0
    token_ids = runner_output.spec_output_token_ids[request.request_id]
    num_accepted = len(token_ids) - 1
    assert 0 <= num_accepted <= num_drafts, (request, token_ids)
    request.num_computed_tokens -= num_drafts - num_accepted
    request.spec_token_ids = []
    return token_ids, num_accepted


def append_tokens(
    request: Request, token_ids: list[int], max_model_len: int
) -> RequestStatus | None:
    """Appends tokens one by one until one finishes the request (the rest are dropped);
    returns that finished status, or None."""
    grammar = request.structured_output
    for token_id in token_ids:
        request.append_output_token_ids([token_id])
        status = check_stop(request, max_model_len)
        # The mask allowed only tokens the grammar accepts, so a refusal means the
        # grammar is done (it allowed nothing but a stop): either way, finish "stop".
        if (
            grammar is not None
            and status is None
            and (not grammar.accept_tokens([token_id]) or grammar.is_terminated())
        ):
            status = RequestStatus.FINISHED_STOPPED
        if status is not None:
            return status
    return None
