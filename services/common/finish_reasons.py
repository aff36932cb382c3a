"""Finish reasons on the wire: the engine's names ("stop", "length", "abort"; None while an
output is open) and the `FinishReason` enum both services send."""

from __future__ import annotations

from pagedserve.v1 import common_pb2

FINISH_REASONS: dict[str | None, int] = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
# The other way: the enum value -> the engine's name ("" while an output is open).
FINISH_REASON_NAMES: dict[int, str] = {code: name or "" for name, code in FINISH_REASONS.items()}
