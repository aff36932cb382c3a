"""What a `collective_rpc` call sends to a rank and what comes back.

    driver -> rank   ("rpc", (method, args, kwargs))        pickled once, sent to every rank
    rank -> driver   ("rpc_result", (True, value))          the Worker method's return value
    rank -> driver   ("rpc_result", (False, (exc, text)))   the exception it raised, and the
                                                            traceback as text

A method that raises does not end the rank: an admin call that fails (a bad LoRA adapter, a
wake-up with an unknown tag) leaves the engine serving, as in one process. The driver
raises the exception of the lowest rank that failed, of the same type (so `except
ValueError` works with either executor), with the rank's traceback as its cause and a note
naming the rank, as `concurrent.futures` reports a worker process's exception.
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any

# How long the ranks may take to answer a collective_rpc: a level-2 wake-up reloads the
# model's weights, as long as a start.
DEFAULT_RPC_TIMEOUT_S = 600.0


class RankTraceback(Exception):
    """The traceback of an exception raised in a rank process (shown as the cause)."""


def call_worker(worker: Any, method: str, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """Runs `worker.method(*args, **kwargs)` in the rank: (True, result) or (False,
    (exception, traceback text)); an exception that does not pickle travels as a
    RuntimeError with its type and message."""
    try:
        return True, getattr(worker, method)(*args, **kwargs)
    except Exception as exc:
        text = traceback.format_exc()
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        return False, (exc, text)


def raise_first_failure(method: str, replies: list[tuple[bool, Any]]) -> list[Any]:
    """The ranks' results in rank order, or raises the lowest failed rank's exception."""
    for rank, (ok, value) in enumerate(replies):
        if not ok:
            exc, text = value
            exc.add_note(f"Raised by rank {rank} in Worker.{method}().")
            raise exc from RankTraceback(f"rank {rank}:\n{text}")
    return [value for _, value in replies]
