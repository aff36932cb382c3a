"""When a request stops on a token or on length (stop *strings* are matched on text, by
the output processor, which then finishes the request through the scheduler)."""

from __future__ import annotations

from engine.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """Returns the finished status the newest token puts `request` in, or None.

    A stop token (EOS unless `ignore_eos`, or one of `stop_token_ids`) only counts once
    `min_tokens` are out; it takes precedence over the length limits it coincides with.
    """
    params = request.sampling_params
    assert params is not None, "pooling requests sample no token"
    if request.num_output_tokens >= params.min_tokens:
        last = request.output_token_ids[-1]
        if last in params.all_stop_token_ids:
            # EOS reports no stop_reason; an explicit stop token id reports itself.
            if last in params.stop_token_ids or last not in params.eos_token_ids:  # type: ignore[operator]
                request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def stop_screen(request: Request, max_model_len: int) -> tuple[int, set[int]]:
    """What `check_stop` can fire on, as cheap tests of the newest token: the output count
    at which a length limit caps the request (`max_tokens`, or the model's length), and the
    stop token ids (the parameters' own set, so EOS ids added later count). Where neither
    hits, `check_stop` returns None; where one does, it decides (`min_tokens`, precedence).
    """
    params = request.sampling_params
    assert params is not None, "pooling requests sample no token"
    cap = max_model_len - len(request.prompt_token_ids)
    if params.max_tokens is not None:
        cap = min(cap, params.max_tokens)
    return cap, params.all_stop_token_ids
