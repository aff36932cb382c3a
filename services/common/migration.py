"""How the engine service tells the tokenizer service "move this stream", not "it failed".

The engine service ends a stream it gives up on without an error of the request's own with
gRPC status UNAVAILABLE and one trailing metadata entry:

    pagedserve-migrate: <reason>      reason: "drained" (SIGTERM and --shutdown-grace ran out,
                                      or a new request reached a draining engine)

Every output's tokens sent before that status are final; the outputs without a finish reason
continue elsewhere, resubmitted with `EngineGenerateRequest.resumed_output_token_ids`
(docs/grpc.md "Migration"). An UNAVAILABLE without the entry is an engine that broke (killed,
unreachable); the tokenizer service migrates those too, with reason "killed". The engine
reports a stalled step through health instead (NOT_SERVING; the Health RPC's details carry
`engine_stalled_s`), since a stalled engine cannot end its streams itself.

No torch and no engine here: the tokenizer service imports this module.
"""

from __future__ import annotations

from typing import Any

import grpc

MIGRATE_METADATA_KEY = "pagedserve-migrate"
# The engine service's Health details entry naming its process (a random id per start): a
# stream does not go back to a replica it left unless the replica is a new process since.
INSTANCE_DETAIL = "instance_id"
REASON_DRAINED = "drained"
REASON_STALLED = "stalled"  # decided by the tokenizer service (health, or silence)
REASON_KILLED = "killed"  # decided by the tokenizer service (a broken call)
MIGRATE_STATUS = grpc.StatusCode.UNAVAILABLE


def migrate_metadata(reason: str) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a stream the engine service hands back."""
    return ((MIGRATE_METADATA_KEY, reason),)


def migrate_reason(error: Any) -> str | None:
    """The reason when `error` (a failed engine-service call: grpc.RpcError /
    grpc.aio.AioRpcError) is the engine service handing the stream back, else None."""
    if error.code() != MIGRATE_STATUS:
        return None
    for key, value in error.trailing_metadata() or ():
        if key == MIGRATE_METADATA_KEY:
            return value if isinstance(value, str) else value.decode()
    return None
