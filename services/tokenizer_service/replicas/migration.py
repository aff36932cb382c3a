"""Streams that survive their replica: when and how a stream moves to another engine replica
after its first token (issue 34, docs/deployment.md "What survives what").

    the replica holding a stream ...                     reason    decided by
    ─ breaks the call (UNAVAILABLE / CANCELLED, not us)  killed    `reason_for_error`
    ─ is marked down because a call found it gone        killed    `StreamWatch.lose`
    ─ hands the stream back (pagedserve-migrate trailer) drained   `reason_for_error`
    ─ sends nothing on any of its streams for
      --engine-stall-timeout s while holding some and
      does not answer its health check, or
      reports NOT_SERVING with engine_stalled_s          stalled   `StreamWatch` + the poll

The relay (relay.py) raises `Moved`; its replica loop asks `RequestMigrations` whether the
request may move (at most --migration-limit times, to a replica that is up and that it has
not left, unless that one has restarted since: `TriedReplicas`), records the move (metric,
span event, log line) and sends `resume_request(...)`: the same request with every
unfinished output's tokens so far in `resumed_output_token_ids`, so the engine continues
each output where it was (same seed, same position) and the client's `TextStream` simply
carries on. The replica left has its
call cancelled: if it recovers it aborts the request and frees its blocks.

Both the state a replica keeps about its streams (`StreamWatch`, one per `EngineBackend`)
and the state a request keeps about its moves (`RequestMigrations`) live here, so the
relay and the replica client only call into them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import trace

from pagedserve.v1 import engine_pb2
from services.common.errors import ServiceError, engine_unreachable
from services.common.migration import (
    REASON_DRAINED,
    REASON_KILLED,
    REASON_STALLED,
    migrate_reason,
)

if TYPE_CHECKING:
    from services.common.metrics import TokenizerMetrics
    from services.tokenizer_service.text_stream import TextStream

logger = logging.getLogger("services.tokenizer")

REASONS = (REASON_KILLED, REASON_STALLED, REASON_DRAINED)
DEFAULT_MIGRATION_LIMIT = 3
DEFAULT_STALL_TIMEOUT_S = 10.0


class Moved(Exception):
    """The replica holding a stream is lost (`reason` in REASONS): continue it elsewhere."""

    def __init__(self, reason: str, error: grpc.aio.AioRpcError | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error

    def client_error(self, address: str) -> ServiceError:
        """What the client gets when the stream may not move (limit reached, no replica)."""
        detail = f" ({self.error.code().name}: {self.error.details()})" if self.error else ""
        return ServiceError(
            grpc.StatusCode.UNAVAILABLE,
            f"the engine service at {address} is unavailable: {self.reason}{detail}",
        )


def reason_for_error(error: grpc.aio.AioRpcError) -> str | None:
    """Why a broken engine call should move its stream: "drained" (the engine handed it
    back), "killed" (the engine is not there); None: the request's own error."""
    reason = migrate_reason(error)
    if reason is not None:
        return reason
    return REASON_KILLED if engine_unreachable(error) else None


# ---- a replica's streams -------------------------------------------------------------------


@dataclass(eq=False)
class HeldStream:
    """One Generate call open on a replica; `lost` is set when the replica is given up."""

    call: Any = None
    lost: str | None = None


class StreamWatch:
    """The Generate streams one replica holds and when it last sent anything on any of them:
    silence for `stall_timeout_s` while holding streams is a stall (a SIGSTOPped process, a
    wedged driver, a partition: the calls stay open but nothing comes)."""

    def __init__(self, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.streams: set[HeldStream] = set()
        self.last_heard = time.monotonic()

    @contextlib.contextmanager
    def hold(self) -> Iterator[HeldStream]:
        if not self.streams:  # silence is counted from the first stream it holds
            self.last_heard = time.monotonic()
        held = HeldStream()
        self.streams.add(held)
        try:
            yield held
        finally:
            self.streams.discard(held)

    def heard(self) -> None:
        self.last_heard = time.monotonic()

    def silent_s(self) -> float:
        """How long a replica holding streams has sent nothing (0 when it holds none)."""
        return time.monotonic() - self.last_heard if self.streams else 0.0

    def stalled(self) -> bool:
        return self.stall_timeout_s > 0 and self.silent_s() > self.stall_timeout_s

    def lose(self, reason: str) -> int:
        """Every stream held is moved away (its call cancelled); how many."""
        lost = list(self.streams)
        self.streams.clear()
        for held in lost:
            held.lost = reason
            if held.call is not None:
                held.call.cancel()
        return len(lost)


# ---- a request's moves ---------------------------------------------------------------------


class TriedReplicas:
    """The replicas one request was sent to, each left out of its next choices while it is
    the same process (`EngineBackend.instance`, from the engine's Health details). A replica
    that failed the request or gave it up is not tried again: one that recovered (a stall
    that ended) may still hold the old copy, whose cancellation it applies only at its next
    step. Restarted at the same address it is a new replica: in a rolling restart a long
    stream visits every replica in turn and then goes back to one restarted meanwhile,
    rather than ending UNAVAILABLE with every replica serving."""

    def __init__(self) -> None:
        self._tried: list[tuple[Any, str | None]] = []  # (replica, its instance then)

    def add(self, replica: Any) -> None:
        self._tried.append((replica, replica.instance))

    def excluded(self) -> list[Any]:
        return [r for r, instance in self._tried if instance is None or r.instance == instance]


class RequestMigrations:
    """How often one request has moved."""

    def __init__(self, limit: int, metrics: TokenizerMetrics, request_id: str) -> None:
        self.limit = limit
        self.metrics = metrics
        self.request_id = request_id
        self.count = 0

    def may_move(self, candidates: list[Any]) -> bool:
        return self.count < self.limit and bool(candidates)

    def record(self, reason: str, left: Any, joined: Any, num_tokens: int) -> None:
        """The metric, the span event on the request's span, one log line."""
        self.count += 1
        self.metrics.request_migrations.labels(reason=reason).inc()
        trace.get_current_span().add_event(
            "migrated",
            {
                "migration.reason": reason,
                "migration.replica_left": left.address,
                "migration.replica_joined": joined.address,
                "migration.count": self.count,
                "migration.output_tokens": num_tokens,
            },
        )
        logger.info(
            "stream migrated to another engine replica",
            extra={
                "request_id": self.request_id,
                "reason": reason,
                "replica_left": left.address,
                "replica_joined": joined.address,
                "migrations": self.count,
                "output_tokens": num_tokens,
            },
        )


def resume_request(
    original: engine_pb2.EngineGenerateRequest, stream: TextStream
) -> engine_pb2.EngineGenerateRequest:
    """The request to send now: `original` until anything came back; after that the same
    request (id, prompt, sampling with its seed, salt, LoRA, priority, fairness) with every
    unfinished output's tokens so far. Finished outputs are left out (the engine refuses an
    output that cannot take one more token)."""
    if not stream.started:
        return original
    request = engine_pb2.EngineGenerateRequest()
    request.CopyFrom(original)
    request.ClearField("resumed_output_token_ids")
    for index, token_ids in stream.resume_points().items():
        request.resumed_output_token_ids[index].ids.extend(token_ids)
    return request
