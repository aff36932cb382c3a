"""The request ids of Generate calls this service cancelled on one replica, which the
replica may not have let go of yet.

A stream that a stop string ends here (or a client's abort, or a migration) has its engine
call cancelled; the client may then reuse the request id at once. Over the multiplexed call
(stream_mux.py) the abort and the new start travel in order on one call and the engine takes
the start in after the abort (engine/front/engine_thread.py). A per-request Generate call is
cancelled on its own HTTP/2 stream and the new one opens on another: gRPC orders nothing
between the two, and a cancelled call tells its client nothing more, so the new call may reach
the engine service while the old one still holds the id there. The engine then answers
ALREADY_EXISTS, as it must for an id in use.

Where this is fixed, and why here (the tokenizer service, not the engine service):
- Only this side knows that the holder is a call it has itself cancelled. The engine service,
  when the new call comes first, has not yet heard of the cancellation: to it the old request
  is as live as any other, and waiting there on every duplicate id would delay the
  ALREADY_EXISTS a client reusing the id of a running request must get at once.
- The engine's answer is the only sure sign that it has let go of the id. So a new call whose
  id is remembered here and that the same replica refuses with ALREADY_EXISTS, before it sent
  anything back, is made again after a short pause, until the engine takes it or
  `RELEASE_GRACE_S` after the cancellation has passed (the engine lets go within a step of
  taking the cancellation in; past the grace, something else holds the id, and the client
  gets the ALREADY_EXISTS). An id refused while not remembered here (a request that is
  really live) is passed through at once; an id going to another replica never waits there
  (the record is the replica's).

The record is bounded in time: an entry lives `RELEASE_GRACE_S`, and is dropped when a new
call with its id is made (the call ends with its own record, if cancelled in turn).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable

RELEASE_GRACE_S = 5.0  # how long after a cancellation its id may still be held by the engine
_FIRST_PAUSE_S = 0.005  # between two tries: doubled each time, up to _MAX_PAUSE_S
_MAX_PAUSE_S = 0.1


class CancelledIds:
    """request id -> until when a refusal of that id on this replica is retried."""

    def __init__(
        self,
        grace_s: float = RELEASE_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self.grace_s = grace_s
        self._clock = clock
        self._until: OrderedDict[str, float] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        self._expire()
        return len(self._until)

    def __contains__(self, request_id: str) -> bool:
        self._expire()
        return request_id in self._until

    def add(self, request_id: str) -> None:
        """The call of `request_id` was cancelled here just now."""
        self._until.pop(request_id, None)
        self._until[request_id] = self._clock() + self.grace_s
        self._expire()

    def take(self, request_id: str) -> IdRelease | None:
        """For a new call of `request_id`: how to wait for the engine to let go of it, or
        None when no cancelled call of it is remembered (a refusal is final)."""
        self._expire()
        until = self._until.pop(request_id, None)
        return None if until is None else IdRelease(until, self._clock)

    def _expire(self) -> None:
        now = self._clock()
        while self._until:
            request_id, until = next(iter(self._until.items()))
            if until > now:
                return
            del self._until[request_id]


class IdRelease:
    """The tries of one new call whose id a call cancelled here may still hold."""

    def __init__(self, until: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.until = until
        self._clock = clock
        self._pause_s = _FIRST_PAUSE_S
        self.num_retries = 0

    async def before_retry(self) -> bool:
        """Pauses before the next try; False (at once) when the grace has passed."""
        left = self.until - self._clock()
        if left <= 0:
            return False
        await asyncio.sleep(min(self._pause_s, left))
        self._pause_s = min(2 * self._pause_s, _MAX_PAUSE_S)
        self.num_retries += 1
        return True
